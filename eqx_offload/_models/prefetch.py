"""The prefetched layer scan of `scan_layers` (`_models/scan.py`): while layer `i`
computes, layer `i + 1`'s host weights come to the device; a custom VJP does the same
downwards in the backward pass, which recomputes each layer, and `custom_vmap` rules
batch the layer inside the scan under `jax.vmap`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._core.errors import CompositionError
from .._core.leaves import is_none
from .._core.move import to_host
from .._core.placement import is_host, packed_vector
from .._stream.backward import fetch_layer, merge
from .params import fetch


# ----------------------------------------------------------------------------------------
# The prefetched layer scan
#
# Iteration `i` computes layer `i` with weights fetched by iteration `i - 1` (carried
# across the loop as device arrays) while it fetches layer `i + 1`'s, so the copy has
# the previous layer's compute to hide under. The backward pass, a reverse scan written
# out by a custom VJP, does the same downwards; a custom VJP because JAX's own transpose
# of such a scan would keep every iteration's carried device weights as residuals (`L`
# layers on the device). The index is clamped, so the last iteration of each pass
# fetches a layer again rather than branching: the forward pass's is the last layer,
# which the backward pass starts with (a residual; why not a fetch of its own: "Why
# the prefetch once raised the peak" in `docs/models.md`).


def offload_input(h: Any) -> Any:
    """A layer's input moved to host memory for the backward pass, but for leaves that
    are `packed_vector`s: the scan would write each layer's row of them into one host
    array, which XLA:TPU cannot (they are small; they stay on the device)."""
    def one(a: Any) -> Any:
        return a if packed_vector(a) else to_host(a)
    return jtu.tree_map(one, h)


def _zero_if_inexact(a: Any) -> Any:
    return jnp.zeros_like(a) if eqx.is_inexact_array(a) else None


def _zeros_like_inexact(tree: Any) -> Any:
    return jtu.tree_map(_zero_if_inexact, tree)


def _axis(batched: Optional[bool]) -> Optional[int]:
    return 0 if batched else None


def _axes(batched: Any) -> Any:
    return jtu.tree_map(_axis, batched)


def _broadcast(tree: Any, batched: Any, size: int) -> Any:
    def one(a: Any, b: bool) -> Any:
        return a if b else jnp.broadcast_to(a, (size, *a.shape))
    return jtu.tree_map(one, tree, batched)


def _all(tree: Any, value: bool) -> Any:
    """`tree` with every leaf replaced by `value` (a vmap rule's batched flags)."""
    def constant(_: Any) -> bool:
        return value
    return jtu.tree_map(constant, tree)


def _add_unless_none(u: Any, v: Any) -> Any:
    return None if u is None else u + v


def _flag_unless_none(c: Any, b: Optional[bool]) -> Optional[bool]:
    return None if c is None else b


def _cotangent(g: Any, a: Any) -> Any:
    """A symbolic zero cotangent (`None`) of an inexact output, made concrete."""
    return jnp.zeros_like(a) if g is None and eqx.is_inexact_array(a) else g


def _check_unbatched(batched_leaves: list[bool]) -> None:
    if any(batched_leaves):
        raise CompositionError(
            "scan_layers(prefetch=True): `jax.vmap` maps over the stacked layers "
            "themselves (an ensemble) with weights in host memory; the prefetch would "
            "slice and stack them across the batch in host memory. Pass prefetch=False, "
            "or vmap over the inputs only.")


@dataclasses.dataclass(frozen=True)
class _LayerScan:
    """The two passes of one prefetched `scan_layers` call, over the flat stacked
    leaves of the layers (`leaves`, in `jax.tree.leaves` order), the input `x` of the
    first layer and the consts of the layer's computation (`consts`: what `call`
    closes over, made explicit by `eqx.filter_closure_convert`).

    **Fields:** `on_host` (per stacked leaf: whether it is in host memory, and so
    prefetched), `length` (the number of layers), `converted` (the closure-converted
    layer computation less its consts: `eqx.combine(consts, converted)(layer_leaves,
    h)` runs one layer), `offload_input` and `unroll` (as `scan_layers`)."""

    on_host: list[bool]
    length: int
    converted: Any
    offload_input: bool
    unroll: int

    def apply(self, layer: list[Any], h: Any, consts: Any, batched: Any) -> Any:
        """One layer; under `vmap` (`batched`: which consts are batched; `h` is), the
        layer is vmapped over the batch inside, its weights not."""
        def one(h: Any, consts: Any) -> Any:
            return eqx.combine(consts, self.converted)(layer, h)
        if batched is None:
            return one(h, consts)
        return jax.vmap(one, in_axes=(0, _axes(batched)))(h, consts)

    def split(self, leaves: list[Any]) -> tuple[list[Any], list[Any]]:
        """`leaves` (one per stacked leaf) as those of host leaves and the others."""
        return ([a for a, h in zip(leaves, self.on_host, strict=True) if h],
                [a for a, h in zip(leaves, self.on_host, strict=True) if not h])

    def forward(self, leaves: list[Any], x: Any, consts: Any, save: bool, batched: Any) -> Any:
        """The forward scan: layer `i` computes with the weights the iteration before
        fetched while it fetches layer `i + 1`'s. Returns the last layer's output, with
        `save` also the residuals of `backward`: each layer's input (in host memory with
        `offload_input`) and the last layer's weights on the device."""
        host_leaves, device_leaves = self.split(leaves)

        def body(carry: Any, xs: Any) -> tuple[Any, Any]:
            h, current = carry
            i, device_slices = xs
            following = fetch_layer(host_leaves, jnp.minimum(i + 1, self.length - 1))
            saved = (offload_input(h) if self.offload_input else h) if save else None
            y = self.apply(merge(current, device_slices, self.on_host), h, consts, batched)
            return (y, following), saved

        first = fetch_layer(host_leaves, 0)
        (out, last), inputs = jax.lax.scan(
            body, (x, first), (jnp.arange(self.length), device_leaves), unroll=self.unroll)
        # The last iteration fetched the last layer again (the clamped index): the
        # backward pass starts with it, rather than fetching it outside its loop.
        return (out, (inputs, last)) if save else out

    def backward(self, leaves: list[Any], consts: Any, residuals: Any, g: Any, batched: Any,
                 acc: Optional[list[Any]] = None) -> Any:
        """The backward scan, from the last layer down: layer `i`'s VJP computes with the
        weights the iteration before fetched while it fetches layer `i - 1`'s; the
        gradients of host leaves go to host. With `acc` (every leaf on the device), each
        layer's gradient is added into its slice of `acc`, carried: the leaves'
        cotangents are then `acc` plus the gradient. Returns the cotangents of `(leaves,
        x, consts)` (`None` for consts that are not inexact arrays)."""
        host_leaves, device_leaves = self.split(leaves)
        inputs, last = residuals
        diff, nondiff = eqx.partition(consts, eqx.is_inexact_array)

        def body(carry: Any, xs: Any) -> tuple[Any, Any]:
            g, current, g_consts, acc = carry
            i, device_slices, h = xs
            preceding = fetch_layer(host_leaves, jnp.maximum(i - 1, 0))
            if self.offload_input:
                h = fetch(h)

            def f(layer: list[Any], h: Any, diff: Any) -> Any:
                return self.apply(layer, h, eqx.combine(diff, nondiff), batched)

            _, vjp = eqx.filter_vjp(f, merge(current, device_slices, self.on_host), h, diff)
            g_layer, g_h, g_c = vjp(g)
            g_host, g_device = self.split(g_layer)
            g_consts = jtu.tree_map(_add_unless_none, g_consts, g_c, is_leaf=is_none)
            if acc is not None:  # every leaf on the device: the sum, no stacked output
                acc = [_add_at(a, i, d) for a, d in zip(acc, g_device, strict=True)]
                g_device = list[Any]()
            return (g_h, preceding, g_consts, acc), (to_host(g_host), g_device)

        zeros = _zeros_like_inexact(diff)
        (g_x, _, g_consts, acc), (g_host, g_device) = jax.lax.scan(
            body, (g, last, zeros, acc), (jnp.arange(self.length), device_leaves, inputs),
            reverse=True, unroll=self.unroll)
        return (merge(g_host, g_device, self.on_host) if acc is None else acc), g_x, g_consts


def _add_at(acc: jax.Array, i: Any, grad: jax.Array) -> jax.Array:
    """`acc` with `grad` added into its slice `i` (in place, for XLA)."""
    total = jax.lax.dynamic_index_in_dim(acc, i, keepdims=False) + grad
    added: jax.Array = jax.lax.dynamic_update_index_in_dim(acc, total, i, 0)
    return added


# Under `vmap` (the Equinox idiom: `jax.vmap(model)(x)`) a custom VJP would be batched
# whole, its backward pass computing every example's weight gradients; these rules
# batch the layer inside instead, so each weight gradient is one sum, as JAX's own
# transpose of a vmapped layer gives it. Batched weights (an ensemble of stacks) are
# refused: their slices and gradients would need the batch axis moved in host memory.


def _forward_pass(scan: _LayerScan, save: bool) -> Any:
    """The forward pass as a `custom_vmap` function of `(leaves, x, consts)`: `out`, or
    with `save` `(out, (inputs, last))` (each layer's input and the last layer's
    weights on the device, for the backward pass; unbatched under `vmap`, the batch
    axis inside)."""
    @jax.custom_batching.custom_vmap
    def run(leaves: list[Any], x: Any, consts: Any) -> Any:
        return scan.forward(leaves, x, consts, save, None)

    @run.def_vmap
    def _(size: int, in_batched: Any, leaves: list[Any], x: Any, consts: Any) -> Any:
        batched_leaves, batched_x, batched_consts = in_batched
        _check_unbatched(batched_leaves)
        result = scan.forward(leaves, _broadcast(x, batched_x, size), consts, save,
                              batched_consts)
        if not save:
            return result, _all(result, True)
        out, residuals = result
        return result, (_all(out, True), _all(residuals, False))

    return run


def _backward_pass(scan: _LayerScan) -> Any:
    """The backward pass as a `custom_vmap` function of `(leaves, consts, residuals, g,
    acc)`: the cotangents of `(leaves, x, consts)` (of the leaves, `acc` plus the
    gradient, unless `acc` is `None`); under `vmap`, the batch axis inside (the weight
    gradients unbatched, summed over it)."""
    @jax.custom_batching.custom_vmap
    def backward_batched(leaves: list[Any], consts: Any, residuals: Any, g: Any,
                         acc: Optional[list[Any]]) -> Any:
        if any(i.ndim == c.ndim + 2
               for i, c in zip(jtu.tree_leaves(residuals[0]), jtu.tree_leaves(g))):
            # The layer inputs of the batched forward rule (`[L, batch, ...]`, marked
            # unbatched: the batch axis is not in front). The backward pass is then
            # batched too and only its rule below computes; `custom_vmap` still traces
            # this function once for one example's types, which are these.
            return _zeros_like_inexact((leaves, g, consts))
        return scan.backward(leaves, consts, residuals, g, None, acc)

    @backward_batched.def_vmap
    def _(size: int, in_batched: Any, leaves: list[Any], consts: Any, residuals: Any,
          g: Any, acc: Optional[list[Any]]) -> Any:
        batched_leaves, batched_consts, batched_residuals, batched_g, batched_acc = in_batched
        _check_unbatched(batched_leaves + (batched_acc or []))
        if any(jtu.tree_leaves(batched_residuals)):  # vmapped twice: a second batch axis
            raise CompositionError(
                "scan_layers(prefetch=True): the backward pass is batched over two axes "
                "(`jax.vmap` around `jax.vmap` around the scan); pass prefetch=False.")
        g_leaves, g_x, g_consts = scan.backward(leaves, consts, residuals,
                                                _broadcast(g, batched_g, size), batched_consts,
                                                acc)
        flags = (_all(g_leaves, False), _all(g_x, True),
                 jtu.tree_map(_flag_unless_none, g_consts, batched_consts, is_leaf=is_none))
        return (g_leaves, g_x, g_consts), flags

    return backward_batched


def prefetched_scan(dynamic: Any, static: Any, x: Any, call: Callable[..., Any],
                     offload_input: bool, unroll: int, acc: Optional[list[Any]] = None) -> Any:
    """`scan_layers` with the next layer's host leaves prefetched in both passes: the
    passes of a `_LayerScan`, tied together by a custom VJP (with `acc`, the leaves'
    cotangent is `acc` plus the gradient; `acc` is not differentiated)."""
    leaves, treedef = jtu.tree_flatten(dynamic)

    def layer_call(layer_leaves: list[Any], carry: Any) -> Any:
        return call(eqx.combine(jtu.tree_unflatten(treedef, layer_leaves), static), carry)

    # `call` may close over traced values (a mask, a differentiated scale): make them
    # explicit, so that the custom VJP differentiates them too.
    example = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in leaves]
    converted = eqx.filter_closure_convert(layer_call, example, x)
    consts, conv_static = eqx.partition(converted, eqx.is_array)
    layer_scan = _LayerScan([is_host(a) for a in leaves], leaves[0].shape[0], conv_static,
                            offload_input, unroll)
    forward_only, forward_saving = _forward_pass(layer_scan, False), _forward_pass(layer_scan, True)
    backward_batched = _backward_pass(layer_scan)

    @eqx.filter_custom_vjp
    def scan(vjp_arg: Any, acc: Optional[list[Any]]) -> Any:
        return forward_only(*vjp_arg)

    def scan_fwd(perturbed: Any, vjp_arg: Any, acc: Optional[list[Any]]) -> Any:
        del perturbed, acc
        return forward_saving(*vjp_arg)

    def scan_bwd(residuals: Any, g: Any, perturbed: Any, vjp_arg: Any,
                 acc: Optional[list[Any]]) -> Any:
        del perturbed
        leaves, x, consts = vjp_arg
        g = jtu.tree_map(_cotangent, g, x, is_leaf=is_none)
        g_leaves, g_x, g_consts = backward_batched(leaves, consts, residuals, g, acc)
        return g_leaves, g_x, g_consts

    rules: Any = scan  # (Equinox's `def_fwd`/`def_bwd` are untyped)
    rules.def_fwd(scan_fwd)
    rules.def_bwd(scan_bwd)

    out: Any = scan((leaves, x, consts), acc)
    return out

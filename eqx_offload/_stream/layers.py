"""The prefetched layer scan, written once: while layer `i` computes, layer `i + 1`'s
host weights come to the device, and a custom VJP does the same downwards in the
backward pass. The backward pass is one of two: the recompute (each layer's VJP,
its gradient handed back: `scan_layers`) or the update (each layer's VJP, its
gradient handed to the optimizer's update of that layer: `_stream/backward.py`, for
`update_in_backward`). `custom_vmap` rules batch the layer inside the scan under
`jax.vmap`.

Iteration `i` computes layer `i` with weights fetched by iteration `i - 1` (carried
across the loop as device arrays) while it fetches layer `i + 1`'s, so the copy has
the previous layer's compute to hide under. A custom VJP because JAX's own transpose
of such a scan would keep every iteration's carried device weights as residuals (`L`
layers on the device). The index is clamped, so the last iteration of each pass
fetches a layer again rather than branching: the forward pass's is the last layer,
which the backward pass starts with (a residual; why not a fetch of its own: "Why the
prefetch once raised the peak" in `docs/models.md`).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._core.errors import CompositionError
from .._core.leaves import is_none
from .._core.move import fetch as fetch, send_to_host  # (fetch: `backward` imports it here)
from .._core.placement import is_host, packed_vector


def fetch_layer(host_leaves: list[Any], i: Any) -> list[Any]:
    """Layer `i`'s slice of each stacked host leaf, moved to the device (sliced in host
    memory, squeezed on the device: only the slice touches host memory)."""
    slices = [layer_slice(a, i) for a in host_leaves]
    return [a[0] for a in fetch(slices)]


def layer_slice(a: Any, i: Any) -> Any:
    """Layer `i` of the stacked `a`, its leading axis kept (of length 1)."""
    return jax.lax.dynamic_slice(a, (i,) + (0,) * (a.ndim - 1), (1,) + a.shape[1:])


def merge(fetched: list[Any], device_slices: list[Any], on_host: list[bool]) -> list[Any]:
    """One layer's leaves in order: the fetched host ones and the device ones."""
    fetched_it, device_it = iter(fetched), iter(device_slices)
    return [next(fetched_it) if h else next(device_it) for h in on_host]


def offload_input(h: Any) -> Any:
    """A layer's input moved to host memory for the backward pass, but for leaves that
    are `packed_vector`s: the scan would write each layer's row of them into one host
    array, which XLA:TPU cannot (they are small; they stay on the device)."""
    def one(a: Any) -> Any:
        return a if packed_vector(a) else send_to_host(a)
    return jtu.tree_map(one, h)


def _zero_if_inexact(a: Any) -> Any:
    return jnp.zeros_like(a) if eqx.is_inexact_array(a) else None


def zeros_like_inexact(tree: Any) -> Any:
    return jtu.tree_map(_zero_if_inexact, tree)


def add_unless_none(u: Any, v: Any) -> Any:
    return None if u is None else u + v


def _axis(batched: Optional[bool]) -> Optional[int]:
    return 0 if batched else None


def broadcast(tree: Any, batched: Any, size: int) -> Any:
    """`tree` with a leading batch axis of `size` on every leaf (`batched`: which have
    one already)."""
    def one(a: Any, b: bool) -> Any:
        return a if b else jnp.broadcast_to(a, (size, *a.shape))
    return jtu.tree_map(one, tree, batched)


def every(tree: Any, value: bool) -> Any:
    """`tree` with every leaf replaced by `value` (a vmap rule's batched flags)."""
    def constant(_: Any) -> bool:
        return value
    return jtu.tree_map(constant, tree)


def _flag_unless_none(c: Any, b: Optional[bool]) -> Optional[bool]:
    return None if c is None else b


def _cotangent(g: Any, a: Any) -> Any:
    """A symbolic zero cotangent (`None`) of an inexact output, made concrete."""
    return jnp.zeros_like(a) if g is None and eqx.is_inexact_array(a) else g


@dataclasses.dataclass(frozen=True)
class LayerScan:
    """The passes of one prefetched layer scan, over the flat stacked leaves of the
    layers (in `jax.tree.leaves` order), the input `x` of the first layer and the
    consts of the layer's computation (`consts`: what it closes over, made explicit by
    `eqx.filter_closure_convert`).

    **Fields:** `on_host` (per stacked leaf: whether it is in host memory, and so
    prefetched), `length` (the number of layers), `converted` (the closure-converted
    layer computation less its consts: `eqx.combine(consts, converted)(layer_leaves,
    h)` runs one layer), `save_input` (moves a layer's input to host memory for the
    backward pass, or `None`), `unroll` (as `jax.lax.scan`) and `batched_layers` (the
    error for `jax.vmap` over the stacked layers themselves)."""

    on_host: list[bool]
    length: int
    converted: Any
    save_input: Optional[Callable[[Any], Any]]
    unroll: int
    batched_layers: str

    def apply(self, layer: list[Any], h: Any, consts: Any, batched: Any) -> Any:
        """One layer; under `vmap` (`batched`: which consts are batched; `h` is), the
        layer is vmapped over the batch inside, its weights not."""
        def one(h: Any, consts: Any) -> Any:
            return eqx.combine(consts, self.converted)(layer, h)
        if batched is None:
            return one(h, consts)
        return jax.vmap(one, in_axes=(0, jtu.tree_map(_axis, batched)))(h, consts)

    def split(self, leaves: list[Any]) -> tuple[list[Any], list[Any]]:
        """`leaves` (one per stacked leaf) as those of host leaves and the others."""
        return ([a for a, h in zip(leaves, self.on_host, strict=True) if h],
                [a for a, h in zip(leaves, self.on_host, strict=True) if not h])

    def check_unbatched(self, flags: Any) -> None:
        if any(jtu.tree_leaves(flags)):
            raise CompositionError(self.batched_layers)

    def forward(self, leaves: list[Any], x: Any, consts: Any, save: bool, batched: Any) -> Any:
        """The forward scan: layer `i` computes with the weights the iteration before
        fetched while it fetches layer `i + 1`'s. Returns the last layer's output, with
        `save` also the residuals of the backward pass: each layer's input (moved by
        `save_input`) and the last layer's weights on the device."""
        host_leaves, device_leaves = self.split(leaves)

        def body(carry: Any, xs: Any) -> tuple[Any, Any]:
            h, current = carry
            i, device_slices = xs
            following = fetch_layer(host_leaves, jnp.minimum(i + 1, self.length - 1))
            saved = None
            if save:
                saved = self.save_input(h) if self.save_input is not None else h
            y = self.apply(merge(current, device_slices, self.on_host), h, consts, batched)
            return (y, following), saved

        first = fetch_layer(host_leaves, 0)
        (out, last), inputs = jax.lax.scan(
            body, (x, first), (jnp.arange(self.length), device_leaves), unroll=self.unroll)
        # The last iteration fetched the last layer again (the clamped index): the
        # backward pass starts with it, rather than fetching it outside its loop.
        return (out, (inputs, last)) if save else out

    def layer_vjp(self, i: Any, g: Any, layer: list[Any], h: Any, consts: Any,
                  batched: Any) -> tuple[list[Any], Any, Any]:
        """Layer `i`'s VJP of `g` from its input `h` (as saved): the cotangents of its
        weights, its input and the inexact consts."""
        diff, nondiff = eqx.partition(consts, eqx.is_inexact_array)
        if self.save_input is not None:
            h = fetch(h)

        def f(layer: list[Any], h: Any, diff: Any) -> Any:
            return self.apply(layer, h, eqx.combine(diff, nondiff), batched)

        _, vjp = eqx.filter_vjp(f, layer, h, diff)
        g_layer, g_h, g_c = vjp(g)
        return g_layer, g_h, g_c

    def backward(self, leaves: list[Any], consts: Any, state: list[Any], shared: list[Any],
                 acc: Optional[list[Any]], residuals: Any, g: Any, batched: Any) -> Any:
        """The recompute, from the last layer down: layer `i`'s VJP computes with the
        weights the iteration before fetched while it fetches layer `i - 1`'s; the
        gradients of host leaves go to host. With `acc` (every leaf on the device), each
        layer's gradient is added into its slice of `acc`, carried: the leaves'
        cotangents are then `acc` plus the gradient. Returns the cotangents of `(leaves,
        x, consts, state)` (`None` for consts that are not inexact arrays; `state` and
        `shared` are empty)."""
        del shared
        host_leaves, device_leaves = self.split(leaves)
        inputs, last = residuals

        def body(carry: Any, xs: Any) -> tuple[Any, Any]:
            g, current, g_consts, acc = carry
            i, device_slices, h = xs
            preceding = fetch_layer(host_leaves, jnp.maximum(i - 1, 0))
            layer = merge(current, device_slices, self.on_host)
            g_layer, g_h, g_c = self.layer_vjp(i, g, layer, h, consts, batched)
            g_host, g_device = self.split(g_layer)
            g_consts = jtu.tree_map(add_unless_none, g_consts, g_c, is_leaf=is_none)
            if acc is not None:  # every leaf on the device: the sum, no stacked output
                acc = [_add_at(a, i, d) for a, d in zip(acc, g_device, strict=True)]
                g_device = list[Any]()
            return (g_h, preceding, g_consts, acc), (send_to_host(g_host), g_device)

        zeros = zeros_like_inexact(eqx.filter(consts, eqx.is_inexact_array))
        (g_x, _, g_consts, acc), (g_host, g_device) = jax.lax.scan(
            body, (g, last, zeros, acc), (jnp.arange(self.length), device_leaves, inputs),
            reverse=True, unroll=self.unroll)
        g_leaves = merge(g_host, g_device, self.on_host) if acc is None else acc
        return g_leaves, g_x, g_consts, list(state)


def _add_at(acc: jax.Array, i: Any, grad: jax.Array) -> jax.Array:
    """`acc` with `grad` added into its slice `i` (in place, for XLA)."""
    total = jax.lax.dynamic_index_in_dim(acc, i, keepdims=False) + grad
    added: jax.Array = jax.lax.dynamic_update_index_in_dim(acc, total, i, 0)
    return added


Backward = Callable[..., Any]
"""A backward pass of a `LayerScan`: `(leaves, consts, state, shared, acc, residuals, g,
batched)` to the "cotangents" of `(leaves, x, consts, state)`."""


# Under `vmap` (the Equinox idiom: `jax.vmap(model)(x)`) a custom VJP would be batched
# whole, its backward pass computing every example's weight gradients; these rules
# batch the layer inside instead, so each weight gradient is one sum, as JAX's own
# transpose of a vmapped layer gives it. Batched weights (an ensemble of stacks) are
# refused: their slices and gradients would need the batch axis moved in host memory.


def _forward_pass(scan: LayerScan, save: bool) -> Any:
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
        scan.check_unbatched(batched_leaves)
        result = scan.forward(leaves, broadcast(x, batched_x, size), consts, save,
                              batched_consts)
        if not save:
            return result, every(result, True)
        out, residuals = result
        return result, (every(out, True), every(residuals, False))

    return run


def _backward_pass(scan: LayerScan, backward: Backward) -> Any:
    """`backward` as a `custom_vmap` function of `(leaves, consts, state, shared, acc,
    residuals, g)`; under `vmap`, the batch axis inside (each layer's gradient summed
    over it, as JAX's transpose of a vmapped layer sums it)."""
    @jax.custom_batching.custom_vmap
    def run(leaves: list[Any], consts: Any, state: list[Any], shared: list[Any],
            acc: Optional[list[Any]], residuals: Any, g: Any) -> Any:
        if any(i.ndim == c.ndim + 2
               for i, c in zip(jtu.tree_leaves(residuals[0]), jtu.tree_leaves(g))):
            # The layer inputs of the batched forward rule (`[L, batch, ...]`, marked
            # unbatched: the batch axis is not in front). The backward pass is then
            # batched too and only its rule below computes; `custom_vmap` still traces
            # this function once for one example's types, which are these.
            return ([a if eqx.is_inexact_array(a) else None for a in leaves],
                    zeros_like_inexact(g), zeros_like_inexact(consts), list(state))
        return backward(leaves, consts, state, shared, acc, residuals, g, None)

    @run.def_vmap
    def _(size: int, in_batched: Any, leaves: list[Any], consts: Any, state: list[Any],
          shared: list[Any], acc: Optional[list[Any]], residuals: Any, g: Any) -> Any:
        b_leaves, b_consts, b_state, b_shared, b_acc, b_residuals, b_g = in_batched
        scan.check_unbatched([b_leaves, b_state, b_shared, b_acc])
        if any(jtu.tree_leaves(b_residuals)):  # vmapped twice: a second batch axis
            raise CompositionError(
                "Call `jax.vmap` once around a prefetched layer scan: its backward pass is "
                "batched over two axes (`jax.vmap` around `jax.vmap`); for `scan_layers`, "
                "pass prefetch=False.")
        new_leaves, g_x, g_consts, new_state = backward(
            leaves, consts, state, shared, acc, residuals, broadcast(g, b_g, size), b_consts)
        flags = (every(new_leaves, False), every(g_x, True),
                 jtu.tree_map(_flag_unless_none, g_consts, b_consts, is_leaf=is_none),
                 every(new_state, False))
        return (new_leaves, g_x, g_consts, new_state), flags

    return run


def layer_scan(dynamic: Any, static: Any, x: Any, call: Callable[..., Any],
               save_input: Optional[Callable[[Any], Any]], unroll: int, batched_layers: str,
               acc: Optional[list[Any]] = None, state: Optional[list[Any]] = None,
               shared: Optional[list[Any]] = None,
               update: Optional[Callable[..., Any]] = None,
               stored: Optional[list[Any]] = None) -> Any:
    """The output of the last of the stacked layers `(dynamic, static)` run from `x` by
    `call(layer, carry)`, with the next layer's host leaves prefetched in both passes.

    The backward pass is the recompute (with `acc`, the leaves' cotangent is `acc` plus
    the gradient), or with `update`, `update(scan, ...)` (a `Backward` after its first
    argument): differentiated with respect to the leaves and to `state`, its
    "cotangents" are then the new weights and state. `acc`, `shared` and `stored` (the
    leaves `state` views in another dtype: the backward pass reads and writes these,
    and returns its new state as views of `state`'s dtype) are not differentiated."""
    leaves, treedef = jtu.tree_flatten(dynamic)

    def layer_call(layer_leaves: list[Any], carry: Any) -> Any:
        return call(eqx.combine(jtu.tree_unflatten(treedef, layer_leaves), static), carry)

    # `call` may close over traced values (a mask, a differentiated scale): make them
    # explicit, so that the custom VJP differentiates them too.
    example = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in leaves]
    converted = eqx.filter_closure_convert(layer_call, example, x)
    consts, conv_static = eqx.partition(converted, eqx.is_array)
    scan = LayerScan([is_host(a) for a in leaves], leaves[0].shape[0], conv_static,
                     save_input, unroll, batched_layers)
    forward_only, forward_saving = _forward_pass(scan, False), _forward_pass(scan, True)
    backward = _backward_pass(
        scan, scan.backward if update is None else functools.partial(update, scan))

    @eqx.filter_custom_vjp
    def run(vjp_arg: Any, shared: list[Any], acc: Optional[list[Any]],
            stored: Optional[list[Any]]) -> Any:
        leaves, x, consts, _ = vjp_arg
        return forward_only(leaves, x, consts)

    def run_fwd(perturbed: Any, vjp_arg: Any, shared: list[Any],
                acc: Optional[list[Any]], stored: Optional[list[Any]]) -> Any:
        del perturbed, shared, acc, stored
        leaves, x, consts, _ = vjp_arg
        return forward_saving(leaves, x, consts)

    def run_bwd(residuals: Any, g: Any, perturbed: Any, vjp_arg: Any,
                shared: list[Any], acc: Optional[list[Any]],
                stored: Optional[list[Any]]) -> Any:
        del perturbed
        leaves, x, consts, views = vjp_arg
        g = jtu.tree_map(_cotangent, g, x, is_leaf=is_none)
        weights, g_x, g_consts, new_state = backward(
            leaves, consts, views if stored is None else stored, shared, acc, residuals, g)
        return weights, g_x, g_consts, [_view(s, v.dtype) for s, v in
                                        zip(new_state, views, strict=True)]

    rules: Any = run  # (Equinox's `def_fwd`/`def_bwd` are untyped)
    rules.def_fwd(run_fwd)
    rules.def_bwd(run_bwd)
    return run((leaves, x, consts, state or []), shared or [], acc, stored)


def _view(a: Any, dtype: Any) -> Any:
    """`a`'s bits as `dtype` (`a` itself where of that dtype)."""
    return a if a.dtype == dtype else jax.lax.bitcast_convert_type(a, dtype)

"""`scan_layers`: stacked layers run by `jax.lax.scan`, each layer's weights in host
memory brought to the device only while that layer computes.

By default the scan prefetches: while layer `i` computes, layer `i + 1`'s weights come
to the device (a custom VJP does the same downwards in the backward pass, which
recomputes each layer). What the prefetch frees and how its copies overlap on a GPU is
on the models docs page (`docs/models.md`, "Stacked layers").
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Optional, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.ad_checkpoint import checkpoint_name

from .._core.compat import marked
from .._core.errors import CompositionError, OptionError
from .._core.leaves import is_none
from .._core.move import to_host
from .._core.placement import is_host
from .._stream.backward import fetch_layer as _fetch_layer, hook_for, merge as _merge
from .backward import scan_hooked
from .params import fetch
from .remat import in_a_scan, LAYER_INPUT, offload_names, packed_vector, Policy, union


_M = TypeVar("_M")
_C = TypeVar("_C")


def _name_layer_input(x: Any) -> Any:
    return checkpoint_name(x, LAYER_INPUT)


def _call_layer(layer: Any, x: Any) -> Any:
    return layer(x)


def scan_layers(
    layers: _M,
    x: _C,
    call: Callable[[_M, _C], _C] = _call_layer,
    *,
    policy: Optional[Policy] = None,
    offload_input: bool = False,
    unroll: int = 1,
    prefetch: bool = True,
    accumulate: Optional[Any] = None,
) -> _C:
    """Runs stacked layers one after the other, each with its weights brought to the
    device only while it computes.

    `layers` is the Equinox idiom for a stack of identical layers: one module whose
    array leaves have a leading axis of length `L` (e.g.
    `eqx.filter_vmap(make_layer)(jax.random.split(key, L))`). `scan_layers` is
    `jax.lax.scan` over that axis with a rematted body (`jax.checkpoint`), so the
    backward pass recomputes each layer from its input. Weights kept in host memory
    (`eqx_offload.to_host(layers)`) come to the device one layer at a time, in the
    forward pass and again in the backward pass, and their gradients go back to host
    memory (`pinned_host`). Leaves already on the device are used as they are; host
    leaves whose layers are vectors of a dtype under 32 bits (bf16 norm scales) come to
    the device whole before the scan, as a TPU cannot copy one such row out of host
    memory ("On a TPU" in `docs/models.md`). On the CPU backend every move is a no-op
    and the result is bitwise that of the same rematted scan without the moves.

    By default (`prefetch=True`) layer `i + 1`'s weights come to the device while layer
    `i` computes (layer `i - 1`'s in the backward pass), which holds one more layer of
    weights on the device. On a GPU a layer's fetches run side by side only with
    `xla_gpu_experimental_parallel_async_compute_limit=32`, which
    `eqx_offload.filter_jit` compiles such a step with by default (with `jax.jit`, pass
    it to `.lower(...).compile(...)`); why, and what it frees: "Stacked layers" in
    `docs/models.md`. Under `jax.vmap` (the model called per example) the layer is
    batched inside the scan, so each weight gradient is one sum, as without offload.

    **Arguments:**

    - `layers`: the stacked layers (any pytree whose array leaves share a leading axis).
    - `x`: the input of the first layer (the carry: any pytree).
    - `call`: `call(layer, x) -> x`, one layer's computation (default `layer(x)`). Close
        over anything else a layer needs (a mask, positions).
    - `policy`: the remat policy of the layer body (default `None`: save nothing,
        recompute the layer in the backward pass). Use `eqx_offload.remat.offload_names`,
        `offload_regex` or `offload_dots` to keep named activations in host memory.
        A policy that saves everything would keep the fetched weights on the device.
    - `offload_input`: keep each layer's input (the residual stream) in host memory
        for the backward pass instead of on the device: the body names it
        `eqx_offload.remat.LAYER_INPUT` and the policy offloads that name. (An input, or a
        value `policy` offloads, that is a vector of a dtype under 32 bits stays on the
        device: "On a TPU" in `docs/models.md`.)
    - `unroll`: as `jax.lax.scan` (with weights in host memory, `unroll=2` does not
        compile for XLA's GPU target: see `docs/models.md`).
    - `prefetch`: bring layer `i + 1`'s host weights to the device while layer `i`
        computes (default `True`; used when some leaf is in host memory and `policy`
        is `None`). `False`: fetch each layer in its own iteration.
    - `accumulate`: a running gradient sum of the layers (the structure of
        `eqx.filter(layers, eqx.is_array)`, each leaf of its layer leaf's shape and
        dtype, on the device), or `None`. Given, the gradient that differentiating
        this call returns for `layers` is `accumulate` plus this call's gradient,
        added layer by layer in the backward scan (in place where `accumulate` is
        donated or a loop's carry): gradient accumulation without a second
        whole-model gradient buffer; each addition is `sum + gradient` in the sum's
        dtype (rounded once, not twice, where XLA folds it into the product that makes
        the gradient: `docs/models.md`). Every leaf of `layers` must be an inexact
        array on the device, and `policy` `None`; `accumulate` is not differentiated.

    **Returns:**

    The output of the last layer.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqx_offload

        layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(
            jax.random.split(jax.random.key(0), 4))
        layers = eqx_offload.to_host(layers)

        def loss(layers, x):
            return jnp.sum(eqx_offload.scan_layers(layers, x) ** 2)

        grads = jax.jit(jax.grad(loss))(layers, jnp.ones(8))
        assert grads.weight.sharding.memory_kind == "pinned_host"
        ```
    """
    if not isinstance(offload_input, bool):
        raise OptionError(f"scan_layers(offload_input={offload_input!r}): pass True or False.")
    if not isinstance(prefetch, bool):
        raise OptionError(f"scan_layers(prefetch={prefetch!r}): pass True or False.")
    dynamic, static = eqx.partition(layers, eqx.is_array)
    hook = hook_for(jtu.tree_leaves(dynamic))
    if hook is not None:  # inside `update_in_backward(...).step`, on the layers it updates
        hooked: _C = scan_hooked(hook, _fetch_packed_vectors(dynamic), static, x, call, policy,
                                offload_input, unroll, accumulate, _offload_input)
        return hooked
    dynamic = _fetch_packed_vectors(dynamic)
    if accumulate is not None:
        acc = _check_accumulate(dynamic, accumulate, policy)
        fused: _C = _prefetched_scan(dynamic, static, x, call, offload_input, unroll, acc)
        return fused
    if prefetch and policy is None and any(is_host(a) for a in jtu.tree_leaves(dynamic)):
        with marked("prefetched"):  # filter_jit's GPU default: the copy limit
            prefetched: _C = _prefetched_scan(dynamic, static, x, call, offload_input, unroll)
        return prefetched
    if offload_input:
        policy = union(offload_names(LAYER_INPUT), policy)
    policy = in_a_scan(policy)

    def layer_body(carry: Any, layer_arrays: Any) -> Any:
        if offload_input:
            carry = jtu.tree_map(_name_layer_input, carry)
        layer = eqx.combine(fetch(layer_arrays), static)
        return call(layer, carry)

    rematted = jax.checkpoint(layer_body, policy=policy)

    def body(carry: Any, layer_arrays: Any) -> tuple[Any, None]:
        return rematted(carry, layer_arrays), None

    out, _ = jax.lax.scan(body, x, dynamic, unroll=unroll)
    result: _C = out
    return result


def _packed_vector(a: Any) -> bool:
    """Whether `a` is a stacked host leaf whose layers are vectors (or scalars) of a
    dtype narrower than 32 bits (bf16, fp8, int8)."""
    return is_host(a) and packed_vector(jax.ShapeDtypeStruct(a.shape[1:], a.dtype))


def _fetch_packed_vectors(dynamic: Any) -> Any:
    """`dynamic` with each `_packed_vector` leaf brought to the device whole, before
    the scan: a TPU tiles the two minor axes of an array and packs 2 (bf16) or 4 (int8,
    fp8) elements of the second-minor one into one 32-bit word, so it cannot copy one
    row of an `(L, D)` bf16 array out of host memory (XLA:TPU: "Sublane slicing size
    must be multiple of element packing factor"), nor write one row of its gradient
    back. These leaves (norm scales, biases) are small; their gradients go to host
    memory whole (JAX transposes the move). Matrices (`ndim >= 3`) are sliced along a
    major axis, which any dtype allows. One move per leaf: under differentiation, one
    move of several leaves would mark an integer leaf as differentiated."""
    def one(a: Any) -> Any:
        return fetch(a) if _packed_vector(a) else a
    return jtu.tree_map(one, dynamic)


def _check_accumulate(dynamic: Any, accumulate: Any, policy: Optional[Policy]) -> list[Any]:
    """`accumulate`'s leaves, checked against the layers' (`dynamic`)."""
    fix = "scan_layers(accumulate=...): "
    if policy is not None:
        raise OptionError(fix + "pass policy=None (the sum is made in scan_layers' own "
                          "backward scan, which recomputes each layer).")
    leaves, acc = jtu.tree_leaves(dynamic), eqx.filter(accumulate, eqx.is_array)
    structure: Any = jtu.tree_structure(acc)  # (`PyTreeDef` is untyped for mypy)
    if structure != jtu.tree_structure(dynamic) or any(
            a.shape != b.shape or a.dtype != b.dtype
            for a, b in zip(leaves, jtu.tree_leaves(acc), strict=True)):
        raise OptionError(fix + "pass a sum of the structure of eqx.filter(layers, "
                          "eqx.is_array), each leaf of its layer leaf's shape and dtype.")
    if any(not eqx.is_inexact_array(a) or is_host(a) for a in leaves + jtu.tree_leaves(acc)):
        raise OptionError(fix + "every leaf of `layers` and of the sum must be an inexact "
                          "array on the device (a sum of host weights' gradients: "
                          "add them yourself).")
    return jtu.tree_leaves(acc)


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


def _offload_input(h: Any) -> Any:
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
            following = _fetch_layer(host_leaves, jnp.minimum(i + 1, self.length - 1))
            saved = (_offload_input(h) if self.offload_input else h) if save else None
            y = self.apply(_merge(current, device_slices, self.on_host), h, consts, batched)
            return (y, following), saved

        first = _fetch_layer(host_leaves, 0)
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
            preceding = _fetch_layer(host_leaves, jnp.maximum(i - 1, 0))
            if self.offload_input:
                h = fetch(h)

            def f(layer: list[Any], h: Any, diff: Any) -> Any:
                return self.apply(layer, h, eqx.combine(diff, nondiff), batched)

            _, vjp = eqx.filter_vjp(f, _merge(current, device_slices, self.on_host), h, diff)
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
        return (_merge(g_host, g_device, self.on_host) if acc is None else acc), g_x, g_consts


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


def _prefetched_scan(dynamic: Any, static: Any, x: Any, call: Callable[..., Any],
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

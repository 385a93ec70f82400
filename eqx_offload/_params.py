"""Parameters in host memory: a model's weights live in `pinned_host` between steps and
during the step, and come to the device only while the layer that uses them computes.

- `scan_layers`: stacked layers (built with `eqx.filter_vmap`) run by `jax.lax.scan`;
  each iteration computes with one layer's slice on the device while it fetches the
  next layer's (a custom VJP does the same in the backward pass, which recomputes each
  layer and fetches its weights again instead of keeping device copies).
- `HostWeights` / `host_weights`: the same for one module of an unscanned model.
- `with_host_params`: an optax transformation that accepts host-resident gradients and
  parameters (its updates are on the device).
- `apply_updates`: `eqx.apply_updates` that keeps every leaf in the memory it lives in.

The gradient of a weight in host memory is in host memory (`pinned_host`): JAX
transposes the `device_put` that fetched it into a `device_put` back to host.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, Optional, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jax.ad_checkpoint import checkpoint_name

from ._compat import same_trace
from ._errors import CompositionError, OptionError
from ._jit import late_params, note_streamed
from ._move import move, to_host
from ._leaves import is_traced
from ._placement import is_host, memory_kind_of
from ._remat import LAYER_INPUT, offload_names, Policy, union
from ._types import HostMemoryKind, Where


_T = TypeVar("_T")
_M = TypeVar("_M")
_C = TypeVar("_C")


def _fetch(tree: _T) -> _T:
    """Every array leaf of `tree` in the device's default memory (those there already
    are not copied)."""
    return move(tree, True, None, "to_device")


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
) -> _C:
    """Runs stacked layers one after the other, each with its weights brought to the
    device only while it computes.

    `layers` is the Equinox idiom for a stack of identical layers: one module whose
    array leaves have a leading axis of length `L` (e.g.
    `eqx.filter_vmap(make_layer)(jax.random.split(key, L))`). `scan_layers` is
    `jax.lax.scan` over that axis with a rematted body (`jax.checkpoint`): the backward
    pass recomputes each layer from its input. Weights kept in host memory
    (`eqx_offload.to_host(layers)`) come to the device one layer at a time, in the
    forward pass and again in the backward pass, and their gradients go back to host
    memory (`pinned_host`). Leaves already on the device are used as they are; on the
    CPU backend every move is a no-op and the result is bitwise that of the same
    rematted scan without the moves.

    By default (`prefetch=True`) the fetches are pipelined: while layer `i` computes,
    layer `i + 1`'s weights come to the device (layer `i - 1`'s in the backward pass),
    so a copy waits for nothing but the layer before it. That holds one more layer of
    weights on the device. On a GPU, XLA's scheduler runs a layer's fetches (one per
    host leaf) side by side only with room for them:
    `xla_gpu_experimental_parallel_async_compute_limit=32`, which
    `eqx_offload.filter_jit` compiles such a step with by default on a GPU (with
    `jax.jit`, pass it to `.lower(...).compile(...)`); XLA's default (2) runs them one
    after the other, most before the layer's kernels. With a `policy`
    or `prefetch=False`, each iteration fetches its own layer at its top instead.
    Under `jax.vmap` (the model called per example) the layer is batched inside the
    scan, so each weight gradient is one sum, as without offload.

    **Arguments:**

    - `layers`: the stacked layers (any pytree whose array leaves share a leading axis).
    - `x`: the input of the first layer (the carry: any pytree).
    - `call`: `call(layer, x) -> x`, one layer's computation (default `layer(x)`). Close
        over anything else a layer needs (a mask, positions).
    - `policy`: the remat policy of the layer body (default `None`: save nothing,
        recompute the layer in the backward pass). Use `eqx_offload.offload_names`,
        `offload_regex` or `offload_dots` to keep named activations in host memory.
        A policy that saves everything would keep the fetched weights on the device.
    - `offload_input`: keep each layer's input (the residual stream) in host memory
        for the backward pass instead of on the device: the body names it
        `eqx_offload.LAYER_INPUT` and the policy offloads that name.
    - `unroll`: as `jax.lax.scan`. (With weights in host memory, XLA's GPU compiler
        of JAX 0.12 rejects `unroll=2`: a layout check fails.)
    - `prefetch`: fetch the next layer's host-resident weights while this layer
        computes (default `True`; used when some leaf is in host memory and `policy`
        is `None`). `False`: fetch each layer in its own iteration.

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
    if prefetch and policy is None and any(is_host(a) for a in jtu.tree_leaves(dynamic)):
        prefetched: _C = _prefetched_scan(dynamic, static, x, call, offload_input, unroll)
        note_streamed("prefetched")  # filter_jit's GPU default: the copy limit
        return prefetched
    if offload_input:
        policy = union(offload_names(LAYER_INPUT), policy)

    def layer_body(carry: Any, layer_arrays: Any) -> Any:
        if offload_input:
            carry = jtu.tree_map(_name_layer_input, carry)
        layer = eqx.combine(_fetch(layer_arrays), static)
        return call(layer, carry)

    rematted = jax.checkpoint(layer_body, policy=policy)

    def body(carry: Any, layer_arrays: Any) -> tuple[Any, None]:
        return rematted(carry, layer_arrays), None

    out, _ = jax.lax.scan(body, x, dynamic, unroll=unroll)
    result: _C = out
    return result


# ----------------------------------------------------------------------------------------
# The prefetched layer scan
#
# Fetching a layer's weights at the top of its own iteration leaves nothing for the
# copy to overlap: every kernel of the layer needs them. Here iteration `i` computes
# layer `i` with weights fetched by iteration `i - 1` (carried across the loop as device
# arrays) while it fetches layer `i + 1`'s; the backward pass, a reverse scan written
# out by a custom VJP, does the same downwards (computing layer `i`'s VJP while it
# fetches layer `i - 1`). A custom VJP because JAX's own transpose of such a scan would
# keep every iteration's carried device weights as residuals: `L` layers on the device.
# The cost is one more layer of weights on the device (the one in flight). The index is
# clamped, so the last iteration of each pass fetches a layer again rather than
# branching: the forward pass's is the last layer, which the backward pass starts with
# (a residual; fetched outside the backward loop instead, XLA's GPU scheduler starts
# that fetch before the forward pass and keeps it through both).


def _fetch_layer(host_leaves: list[Any], i: Any) -> list[Any]:
    """Layer `i`'s slice of each stacked host leaf, moved to the device (sliced in host
    memory, squeezed on the device: only the slice touches host memory)."""
    slices = [jax.lax.dynamic_slice(a, (i,) + (0,) * (a.ndim - 1), (1,) + a.shape[1:])
              for a in host_leaves]
    return [a[0] for a in _fetch(slices)]


def _merge(fetched: list[Any], device_slices: list[Any], on_host: list[bool]) -> list[Any]:
    fetched_it, device_it = iter(fetched), iter(device_slices)
    return [next(fetched_it) if h else next(device_it) for h in on_host]


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
            saved = (to_host(h) if self.offload_input else h) if save else None
            y = self.apply(_merge(current, device_slices, self.on_host), h, consts, batched)
            return (y, following), saved

        first = _fetch_layer(host_leaves, 0)
        (out, last), inputs = jax.lax.scan(
            body, (x, first), (jnp.arange(self.length), device_leaves), unroll=self.unroll)
        # The last iteration fetched the last layer again (the clamped index): the
        # backward pass starts with it, rather than fetching it outside its loop.
        return (out, (inputs, last)) if save else out

    def backward(self, leaves: list[Any], consts: Any, residuals: Any, g: Any, batched: Any) -> Any:
        """The backward scan, from the last layer down: layer `i`'s VJP computes with the
        weights the iteration before fetched while it fetches layer `i - 1`'s; the
        gradients of host leaves go to host. Returns the cotangents of `(leaves, x,
        consts)` (`None` for consts that are not inexact arrays)."""
        host_leaves, device_leaves = self.split(leaves)
        inputs, last = residuals
        diff, nondiff = eqx.partition(consts, eqx.is_inexact_array)

        def body(carry: Any, xs: Any) -> tuple[Any, Any]:
            g, current, g_consts = carry
            i, device_slices, h = xs
            preceding = _fetch_layer(host_leaves, jnp.maximum(i - 1, 0))
            if self.offload_input:
                h = _fetch(h)

            def f(layer: list[Any], h: Any, diff: Any) -> Any:
                return self.apply(layer, h, eqx.combine(diff, nondiff), batched)

            _, vjp = eqx.filter_vjp(f, _merge(current, device_slices, self.on_host), h, diff)
            g_layer, g_h, g_c = vjp(g)
            g_host, g_device = self.split(g_layer)
            g_consts = jtu.tree_map(_add_unless_none, g_consts, g_c, is_leaf=_is_none)
            return (g_h, preceding, g_consts), (to_host(g_host), g_device)

        zeros = _zeros_like_inexact(diff)
        (g_x, _, g_consts), (g_host, g_device) = jax.lax.scan(
            body, (g, last, zeros), (jnp.arange(self.length), device_leaves, inputs),
            reverse=True, unroll=self.unroll)
        return _merge(g_host, g_device, self.on_host), g_x, g_consts


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
    """The backward pass as a `custom_vmap` function of `(leaves, consts, residuals,
    g)`: the cotangents of `(leaves, x, consts)`; under `vmap`, the batch axis inside
    (the weight gradients unbatched, summed over it)."""
    @jax.custom_batching.custom_vmap
    def backward_batched(leaves: list[Any], consts: Any, residuals: Any, g: Any) -> Any:
        if any(i.ndim == c.ndim + 2
               for i, c in zip(jtu.tree_leaves(residuals[0]), jtu.tree_leaves(g))):
            # The layer inputs of the batched forward rule (`[L, batch, ...]`, marked
            # unbatched: the batch axis is not in front). The backward pass is then
            # batched too and only its rule below computes; `custom_vmap` still traces
            # this function once for one example's types, which are these.
            return _zeros_like_inexact((leaves, g, consts))
        return scan.backward(leaves, consts, residuals, g, None)

    @backward_batched.def_vmap
    def _(size: int, in_batched: Any, leaves: list[Any], consts: Any, residuals: Any,
          g: Any) -> Any:
        batched_leaves, batched_consts, batched_residuals, batched_g = in_batched
        _check_unbatched(batched_leaves)
        if any(jtu.tree_leaves(batched_residuals)):  # vmapped twice: a second batch axis
            raise CompositionError(
                "scan_layers(prefetch=True): the backward pass is batched over two axes "
                "(`jax.vmap` around `jax.vmap` around the scan); pass prefetch=False.")
        g_leaves, g_x, g_consts = scan.backward(leaves, consts, residuals,
                                                _broadcast(g, batched_g, size), batched_consts)
        flags = (_all(g_leaves, False), _all(g_x, True),
                 jtu.tree_map(_flag_unless_none, g_consts, batched_consts, is_leaf=_is_none))
        return (g_leaves, g_x, g_consts), flags

    return backward_batched


def _prefetched_scan(dynamic: Any, static: Any, x: Any, call: Callable[..., Any],
                     offload_input: bool, unroll: int) -> Any:
    """`scan_layers` with the next layer's host leaves prefetched in both passes: the
    passes of a `_LayerScan`, tied together by a custom VJP."""
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
    def scan(vjp_arg: Any) -> Any:
        return forward_only(*vjp_arg)

    def scan_fwd(perturbed: Any, vjp_arg: Any) -> Any:
        del perturbed
        return forward_saving(*vjp_arg)

    def scan_bwd(residuals: Any, g: Any, perturbed: Any, vjp_arg: Any) -> Any:
        del perturbed
        leaves, x, consts = vjp_arg
        g = jtu.tree_map(_cotangent, g, x, is_leaf=_is_none)
        g_leaves, g_x, g_consts = backward_batched(leaves, consts, residuals, g)
        return g_leaves, g_x, g_consts

    rules: Any = scan  # (Equinox's `def_fwd`/`def_bwd` are untyped)
    rules.def_fwd(scan_fwd)
    rules.def_bwd(scan_bwd)

    out: Any = scan((leaves, x, consts))
    return out


class HostWeights(eqx.Module, Generic[_M]):
    """A module whose weights in host memory come to the device when it is called.

    The call brings every host-resident array leaf of `module` to the device, calls
    `module` there, and is rematted (`jax.checkpoint`), so the backward pass fetches the
    weights again rather than keeping the device copies alive between the two passes.
    Gradients with respect to `module`'s host-resident leaves are in host memory
    (`pinned_host`). Build it with `eqx_offload.host_weights`, which also moves the
    weights; `HostWeights(module)` wraps a module as it is.

    **Fields:**

    - `module`: the wrapped module (any callable pytree).
    - `policy`: the remat policy of the call (default `None`: save nothing).
    """

    module: _M
    policy: Optional[Policy] = eqx.field(static=True, default=None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dynamic, static = eqx.partition(self.module, eqx.is_array)

        def run(dynamic: Any, args: Any, kwargs: Any) -> Any:
            module: Any = eqx.combine(_fetch(dynamic), static)
            return module(*args, **kwargs)

        return eqx.filter_checkpoint(run, policy=self.policy)(dynamic, args, kwargs)


def host_weights(
    module: _M, where: Where = True, *, policy: Optional[Policy] = None,
    memory_kind: HostMemoryKind = "pinned_host",
) -> HostWeights[_M]:
    """Moves the selected weights of `module` to host memory and wraps it in a
    `HostWeights`, so they come to the device only while it computes.

    **Arguments:**

    - `module`: any callable Equinox module (a layer, a block, a whole model).
    - `where`: which array leaves to keep in host memory (see `to_host`). Default every
        array.
    - `policy`: the remat policy of the call (see `HostWeights`).
    - `memory_kind`: `"pinned_host"` (default) or `"unpinned_host"` (eager use only).

    **Returns:**

    A `HostWeights` around the moved module.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqx_offload

        mlp = eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(0))
        mlp = eqx.tree_at(lambda m: m.layers[1], mlp,
                          replace_fn=eqx_offload.host_weights)
        grads = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x))))(
            mlp, jnp.ones(4))
        assert grads.layers[1].module.weight.sharding.memory_kind == "pinned_host"
        assert grads.layers[0].weight.sharding.memory_kind == "device"
        ```
    """
    return HostWeights(to_host(module, where, memory_kind=memory_kind), policy)


# ----------------------------------------------------------------------------------------
# The rest of the step


def _is_none(x: Any) -> bool:
    return x is None


def apply_updates(model: _T, updates: Any) -> _T:
    """`eqx.apply_updates` that keeps every leaf in the memory it lives in.

    A parameter in host memory is updated on the device: it and its update come to
    the device, are added there, and the sum goes back to the parameter's memory kind.
    Parameters on the device are updated as `eqx.apply_updates` does (an update in host
    memory is brought to the device first). The result is bitwise that of
    `eqx.apply_updates` on the same values; `eqx.apply_updates` itself would add host
    arrays, which `eqx_offload.filter_jit` refuses (and XLA runs on the host).

    **Arguments:**

    - `model`: the model (or any pytree of parameters); non-array leaves are kept.
    - `updates`: a pytree prefix-compatible with `model` as for `eqx.apply_updates`,
        with `None` where nothing changes.

    **Returns:**

    The updated model, each array leaf in the memory kind of `model`'s leaf.

    !!! Example

        ```python
        import jax.numpy as jnp
        import eqx_offload

        params = eqx_offload.to_host({"w": jnp.ones(3), "b": jnp.ones(3)}, where={"w": True, "b": False})
        new = eqx_offload.apply_updates(params, {"w": jnp.ones(3), "b": jnp.ones(3)})
        assert new["w"].sharding.memory_kind == "pinned_host"
        assert new["b"].sharding.memory_kind == "device"
        ```
    """
    pairs_def: Any = jtu.tree_structure(updates, is_leaf=_is_none)  # (PyTreeDef: untyped)
    p_leaves = pairs_def.flatten_up_to(model)
    u_leaves = jtu.tree_leaves(updates, is_leaf=_is_none)
    home = [memory_kind_of(p) if is_host(p) else None for p in p_leaves]
    touched = [i for i, u in enumerate(u_leaves) if u is not None]
    fetched_p, fetched_u = _fetch(([_waited(p_leaves[i]) for i in touched],
                                   [u_leaves[i] for i in touched]))
    sums = [p + u for p, u in zip(fetched_p, fetched_u, strict=True)]
    back = [i for i, j in enumerate(touched) if home[j] is not None]
    if back:
        kinds = {home[touched[i]] for i in back}
        for kind in kinds:
            chosen = [i for i in back if home[touched[i]] == kind]
            moved = move([sums[i] for i in chosen], True, kind, "apply_updates")
            for i, x in zip(chosen, moved, strict=True):
                sums[i] = x
    new_leaves = list(p_leaves)
    for i, x in zip(touched, sums, strict=True):
        new_leaves[i] = x
    out: _T = pairs_def.unflatten(new_leaves)
    return out


def _after_gradients(params: Any, grads: Any) -> Any:
    """`params` with each host-resident leaf made to wait for its gradient (the leaf of
    `grads` at the same place) by a `jax.lax.optimization_barrier`, while `filter_jit`
    traces the step (`late_params`; as it is otherwise).

    XLA's GPU scheduler starts the update's copy of a parameter to the device wherever
    that hides it best, which for a stacked layer's weights in a `scan_layers` step is
    before the forward pass: the copy then holds the whole stacked leaf on the device
    through both passes (in the plan of the benchmark's transformer, 108 MiB, and with
    it a step's peak 83 MiB above the same step fetching at the top of each
    iteration). Waiting for the gradient, it comes in after the backward pass produced
    that gradient. The table lets `apply_updates` fetch the same value, so XLA still
    copies each parameter once; the barrier passes values through unchanged."""
    table = late_params()
    if table is None:
        return params

    def wait(p: Any, g: Any) -> Any:
        if (p is None or g is None or not is_host(p) or not eqx.is_array(g)
                or not same_trace(p, g)):
            return p
        waited, _ = jax.lax.optimization_barrier((p, g))
        table[id(p)] = (p, waited)
        return waited

    try:
        return jtu.tree_map(wait, params, grads, is_leaf=_is_none)
    except ValueError:  # not the same structure: nothing to pair
        return params


def _waited(p: Any) -> Any:
    """The value `with_host_params` fetched for host parameter `p` in this trace (see
    `_after_gradients`), or `p`."""
    table = late_params()
    found = None if table is None else table.get(id(p))
    return found[1] if found is not None and found[0] is p else p


def fetch_each(tree: _T) -> _T:
    """`_fetch`, one `device_put` per traced leaf, and unconditional: traced on
    `ShapeDtypeStruct`s that say nothing of memory (as the streamed update traces
    `inner.update`), the move is still in the program, and each leaf's move belongs to
    its own parameter (so the streamed update fetches it with that parameter's group)."""
    leaves, treedef = jtu.tree_flatten(tree)
    traced = [i for i, x in enumerate(leaves) if is_traced(x)]
    for i in traced:
        leaves[i] = jax.device_put(leaves[i], jax.memory.Space.Device)
    rest = [i for i, x in enumerate(leaves) if i not in set(traced) and eqx.is_array(x)]
    for i, x in zip(rest, _fetch([leaves[i] for i in rest]), strict=True):
        leaves[i] = x
    out: _T = jtu.tree_unflatten(treedef, leaves)
    return out


def place_like(tree: _T, like: Any) -> _T:
    """Each array leaf of `tree` moved to the host memory kind of the leaf of `like` at
    the same place, if that one is in host memory (one move per kind)."""
    leaves, treedef = jtu.tree_flatten(tree)
    homes = [memory_kind_of(x) if is_host(x) else None for x in jtu.tree_leaves(like)]
    for kind in {h for h in homes if h is not None}:
        chosen = [i for i, h in enumerate(homes) if h == kind and eqx.is_array(leaves[i])]
        moved = move([leaves[i] for i in chosen], True, kind, "memory_kind")
        for i, x in zip(chosen, moved, strict=True):
            leaves[i] = x
    out: _T = jtu.tree_unflatten(treedef, leaves)
    return out


def with_host_params(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation so that it accepts parameters and gradients in
    host memory.

    `init` and `update` bring host-resident `params` and `updates` to the device (one
    move per leaf) and run `inner` there; the updates stay on the device, where
    `eqx_offload.apply_updates` adds them to the host-resident weights and sends the
    sums back. Its state and updates are bitwise those of `inner`. Put it inside
    `offloaded` to keep the optimizer state in host memory too:
    `offloaded(with_host_params(optax.adamw(1e-3)))`; with `group_bytes` the gradients
    and weights then come to the device with their parameter's group of state.
    Otherwise, in a step traced by `eqx_offload.filter_jit`, each host-resident
    parameter waits for its gradient before it comes to the device (a
    `jax.lax.optimization_barrier`, which passes values unchanged), and
    `eqx_offload.apply_updates` fetches that same value: XLA's GPU scheduler then copies
    each weight to the device once, after the backward pass made its gradient, rather
    than wherever it would start the copy (for a `scan_layers` stack, before the
    forward pass, holding the stacked weight on the device through both passes).

    **Arguments:**

    - `inner`: any `optax.GradientTransformation`.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` with the same state as `inner`.

    !!! Example

        ```python
        import jax.numpy as jnp
        import optax
        import eqx_offload

        params = eqx_offload.to_host({"w": jnp.ones(3)})
        opt = eqx_offload.offloaded(eqx_offload.with_host_params(optax.adam(0.1)))
        state = opt.init(params)
        updates, state = opt.update(params, state, params)
        assert updates["w"].sharding.memory_kind == "device"
        params = eqx_offload.apply_updates(params, updates)
        assert params["w"].sharding.memory_kind == "pinned_host"
        ```
    """
    transformation = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> optax.OptState:
        return transformation.init(fetch_each(params))

    def update_fn(
        updates: optax.Updates, state: optax.OptState, params: Optional[optax.Params] = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        if params is not None:
            params = _after_gradients(params, updates)
        return transformation.update(
            fetch_each(updates), state, fetch_each(params), **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

"""The update inside the backward pass: a layer scan whose backward pass updates each
layer as it makes its gradient.

A custom VJP ties two scans over stacked layers. The forward scan runs layer `i` with
weights the iteration before brought from host memory while it brings layer `i + 1`'s
(as `scan_layers`' prefetching scan). The backward scan, from the last layer down,
recomputes layer `i`'s VJP, hands its gradient, its weights and its slice of the
optimizer state to the `update` it was given, and writes the new weights and state
into their stacked arrays at `i` (in place: the arrays are the loop's carry, so XLA
updates the donated buffers). What the custom VJP returns as the "cotangents" of the
weights and of the state are these new arrays: the caller (`_models/backward.py`)
differentiates the loss with respect to them and reads the new model and state off
the gradient. The whole gradient of the layers never exists: each layer's is consumed
by its update in the iteration that makes it.

`update(g_layer, w_layer, s_layer, shared) -> (new_w_layer, new_s_layer)` takes and
returns flat lists of one layer's leaves, each with a leading axis of 1 (the slice of
the stack, so that an optimizer's state of the slice has the shapes `init` gives a
one-layer stack); state slices are in the memory the state lives in.

The hook: `hooked(hook)` makes `scan_layers` (`_models/scan.py`) run this scan when it
is called on exactly the stacked leaves the hook names (`hook_for`).
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._core.errors import CompositionError
from .._core.leaves import is_none
from .._core.move import move, to_host
from .._core.placement import is_host, stacked_packed_vector


Update = Callable[[list[Any], list[Any], list[Any], list[Any]], tuple[list[Any], list[Any]]]


@dataclasses.dataclass
class Hook:
    """What the step hands the layer scan: the stacked weight leaves it must be called
    on (`leaves`, matched by identity), the optimizer state's stacked per-layer leaves
    (`state`, differentiated: their "cotangents" are the new state), the state's other
    leaves (`shared`: a step counter), the per-layer `update` and, where gradients are
    summed over micro-batches, the stacked sum of the earlier ones (`accumulated`,
    added to each layer's gradient before its update). `calls` counts the scans that
    ran it. `stored`, where given: the per-layer leaves as stored, of which `state`
    holds views in another dtype (8-bit state's packed codes as float32 bits, so that
    their "cotangent" can carry the new state); the backward pass reads and writes
    these, and returns them as views of `state`'s dtype: no view of a whole stack is
    made in host memory (a TPU would convert it there, into a new host buffer)."""

    leaves: list[Any]
    state: list[Any]
    shared: list[Any]
    update: Update
    accumulated: Optional[list[Any]] = None
    calls: int = 0
    stored: Optional[list[Any]] = None


_ACTIVE: contextvars.ContextVar[Optional[Hook]] = contextvars.ContextVar(
    "eqx_offload_backward_update", default=None)


@contextlib.contextmanager
def hooked(hook: Hook) -> Iterator[Hook]:
    """`scan_layers` calls on `hook.leaves` run the update scan, within the block."""
    token = _ACTIVE.set(hook)
    try:
        yield hook
    finally:
        _ACTIVE.reset(token)


def hook_for(leaves: list[Any]) -> Optional[Hook]:
    """The active hook if `leaves` are exactly its stacked leaves, else `None`."""
    hook = _ACTIVE.get()
    if hook is None or len(leaves) != len(hook.leaves):
        return None
    if all(a is b for a, b in zip(leaves, hook.leaves, strict=True)):
        return hook
    return None


def fetch(tree: Any) -> Any:
    return move(tree, True, None, "to_device")


def fetch_layer(host_leaves: list[Any], i: Any) -> list[Any]:
    """Layer `i`'s slice of each stacked host leaf, moved to the device (sliced in host
    memory, squeezed on the device: only the slice touches host memory)."""
    slices = [_slice(a, i) for a in host_leaves]
    return [a[0] for a in fetch(slices)]


def _slice(a: Any, i: Any) -> Any:
    return jax.lax.dynamic_slice(a, (i,) + (0,) * (a.ndim - 1), (1,) + a.shape[1:])


def _write(a: Any, i: Any, piece: Any) -> Any:
    """`a` with `piece` (leading axis 1) written at layer `i`."""
    return jax.lax.dynamic_update_slice(a, piece, (i,) + (0,) * (a.ndim - 1))


def merge(fetched: list[Any], device_slices: list[Any], on_host: list[bool]) -> list[Any]:
    """One layer's leaves in order: the fetched host ones and the device ones."""
    fetched_it, device_it = iter(fetched), iter(device_slices)
    return [next(fetched_it) if h else next(device_it) for h in on_host]


def _zero_if_inexact(a: Any) -> Any:
    return jnp.zeros_like(a) if eqx.is_inexact_array(a) else None


def _zeros_like_inexact(tree: Any) -> Any:
    return jtu.tree_map(_zero_if_inexact, tree)


def _add_unless_none(u: Any, v: Any) -> Any:
    return None if u is None else u + v


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


def _flag_unless_none(c: Any, b: Optional[bool]) -> Optional[bool]:
    return None if c is None else b


def _cotangent(g: Any, a: Any) -> Any:
    """A symbolic zero cotangent (`None`) of an inexact output, made concrete."""
    return jnp.zeros_like(a) if g is None and eqx.is_inexact_array(a) else g


def _check_unbatched(flags: list[Any]) -> None:
    if any(jtu.tree_leaves(flags)):
        raise CompositionError(
            "Call `jax.vmap` over the inputs only: the update inside the backward pass "
            "updates one stack of layers and one state, not a batch of them.")


@dataclasses.dataclass(frozen=True)
class UpdateScan:
    """The two passes of one layer scan with the update in its backward pass, over the
    flat stacked weight leaves (`on_host`: which are in host memory), `length` layers,
    the closure-converted layer computation less its consts (`converted`),
    `save_input` (moves a layer's input to host memory for the backward pass, or
    `None`), `unroll`, the per-layer `update` and `whole_state`."""

    on_host: list[bool]
    length: int
    converted: Any
    save_input: Optional[Callable[[Any], Any]]
    unroll: int
    update: Update
    # Per state leaf: updated on the device whole (fetched before the backward scan, back
    # to host after it), where a TPU cannot slice a layer of it in host memory (a bf16
    # moment of a norm scale: `stacked_packed_vector`), as the layer scan does with such
    # weights; they are small. The update is still handed host slices of them.
    whole_state: list[bool]

    def apply(self, layer: list[Any], h: Any, consts: Any, batched: Any) -> Any:
        def one(h: Any, consts: Any) -> Any:
            return eqx.combine(consts, self.converted)(layer, h)
        if batched is None:
            return one(h, consts)
        return jax.vmap(one, in_axes=(0, _axes(batched)))(h, consts)

    def split(self, leaves: list[Any]) -> tuple[list[Any], list[Any]]:
        return ([a for a, h in zip(leaves, self.on_host, strict=True) if h],
                [a for a, h in zip(leaves, self.on_host, strict=True) if not h])

    def forward(self, leaves: list[Any], x: Any, consts: Any, save: bool, batched: Any) -> Any:
        """Layer `i` computes while layer `i + 1`'s host weights come to the device.
        With `save`, also each layer's input and the last layer's fetched weights."""
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
        return (out, (inputs, last)) if save else out

    def update_layer(self, todo: Any, shared: list[Any]) -> Any:
        """The update stage: `todo` (`(i, gradient, weights, state slices)` of layer
        `i`) as `(i, new weights, new state slices on the device)`."""
        i, g_layer, layer, state_slices = todo
        new_layer, new_state = self.update(g_layer, layer, state_slices, shared)
        return i, new_layer, fetch(new_state)

    def backward(self, leaves: list[Any], consts: Any, state: list[Any], shared: list[Any],
                 acc: Optional[list[Any]], residuals: Any, g: Any, batched: Any) -> Any:
        """From the last layer down, a pipeline of three stages per iteration `i`:
        layer `i`'s VJP (while layer `i - 1`'s host weights come to the device), the
        update of layer `i + 1` (with the gradient the iteration before made: it runs
        beside the VJP), and the write of layer `i + 2`'s new weights and state into
        the stacked arrays (the loop's carry). The last two stages of the first layer
        run after the loop. Returns `(new weights, cotangent of x,
        cotangents of consts, new state)`.

        The stages are apart so that each update is its own computation on whole
        operands, as in the normal step: XLA:CPU compiles an update fused into the
        slices it reads or the `dynamic-update-slice` it is written by without the
        normal step's fused multiply-adds, so it would round otherwise."""
        inputs, last = residuals
        diff, nondiff = eqx.partition(consts, eqx.is_inexact_array)
        top = self.length - 1
        weights = list(leaves)
        whole = self.whole_state
        state = [fetch(s) if w else s for s, w in zip(state, whole, strict=True)]

        def layer_vjp(i: Any, g: Any, current: list[Any], weights: list[Any],
                      state: list[Any], h: Any) -> Any:
            """Layer `i`'s gradient and the update's inputs, the cotangents of its
            input and consts, and layer `i - 1`'s fetched host weights."""
            host_weights, device_weights = self.split(weights)
            preceding = fetch_layer(host_weights, jnp.maximum(i - 1, 0))
            device_slices = [jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
                             for a in device_weights]
            layer = merge(current, device_slices, self.on_host)
            if self.save_input is not None:
                h = fetch(h)

            def f(layer: list[Any], h: Any, diff: Any) -> Any:
                return self.apply(layer, h, eqx.combine(diff, nondiff), batched)

            _, vjp = eqx.filter_vjp(f, layer, h, diff)
            g_layer, g_h, g_c = vjp(g)
            if acc is not None:  # the sum of the earlier micro-batches, plus this one's
                g_layer = [jax.lax.dynamic_index_in_dim(a, i, keepdims=False) + d
                           for a, d in zip(acc, g_layer, strict=True)]
            todo = (i, [a[None] for a in g_layer], [a[None] for a in layer],
                    _state_slices(state, whole, i))
            return todo, g_h, g_c, preceding

        def update(todo: Any) -> Any:
            return self.update_layer(todo, shared)

        def body(carry: Any, xs: Any) -> tuple[Any, None]:
            g, current, g_consts, weights, state, todo, done = carry
            i, h = xs
            weights, state = _written(weights, state, done)
            done = update(todo)
            todo, g_h, g_c, preceding = layer_vjp(i, g, current, weights, state, h)
            g_consts = jtu.tree_map(_add_unless_none, g_consts, g_c, is_leaf=is_none)
            return (g_h, preceding, g_consts, weights, state, todo, done), None

        # The first iteration's stages 2 and 3 have nothing to do: they update the last
        # layer with zeros and write it unchanged; the real update of the last layer is
        # written over that one later. (Running the last layer's VJP before the loop
        # instead would compile it apart from the others, with other roundings.)
        pieces = [jnp.zeros((1,) + a.shape[1:], a.dtype) for a in leaves]
        todo = (top, pieces, pieces, _state_slices(state, whole, top))
        done = (top, fetch([_slice(a, top) for a in weights]), fetch([_slice(s, top) for s in state]))
        g_consts = _zeros_like_inexact(diff)
        (g_x, _, g_consts, weights, state, todo, done), _ = jax.lax.scan(
            body, (g, last, g_consts, weights, list(state), todo, done),
            (jnp.arange(self.length), inputs), reverse=True, unroll=self.unroll)
        weights, state = _written(weights, state, done)
        weights, state = _written(weights, state, _apart(update, todo))
        state = [to_host(s) if w else s for s, w in zip(state, whole, strict=True)]
        return weights, g_x, g_consts, state


def _apart(update: Callable[[Any], Any], todo: Any) -> Any:
    """`update(todo)` under a conditional: otherwise XLA:CPU fuses the last layer's update
    into the write of its result (an optimization barrier does not survive its passes)
    and contracts its multiply-adds otherwise than the normal step."""
    return jax.lax.cond(todo[0] >= 0, update, update, todo)


def _state_slices(state: list[Any], whole: list[bool], i: Any) -> list[Any]:
    """Layer `i`'s slice of each state leaf, in host memory (a `whole` one, on the
    device, sliced there and moved)."""
    return [to_host(_slice(s, i)) if w else _slice(s, i)
            for s, w in zip(state, whole, strict=True)]


def _written(weights: list[Any], state: list[Any], done: Any) -> tuple[list[Any], list[Any]]:
    """`weights` and `state` with the layer `done` holds (`(i, layer, state slice)`,
    each leaf with a leading axis of 1) written at `i`."""
    i, layer, slices = done
    return ([_write(a, i, to_host(w) if is_host(a) else w) for a, w in zip(weights, layer, strict=True)],
            [_write(a, i, to_host(s) if is_host(a) else s) for a, s in zip(state, slices, strict=True)])


def _forward_pass(scan: UpdateScan, save: bool) -> Any:
    """The forward pass as a `custom_vmap` function of `(leaves, x, consts)`; under
    `vmap` the batch axis is inside (the residuals unbatched)."""
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


def _backward_pass(scan: UpdateScan) -> Any:
    """The backward pass as a `custom_vmap` function of `(leaves, consts, state,
    shared, residuals, g)`; under `vmap`, the batch axis inside (the layer's gradient
    summed over it before the update, as JAX's transpose of a vmapped layer sums it)."""
    @jax.custom_batching.custom_vmap
    def run(leaves: list[Any], consts: Any, state: list[Any], shared: list[Any],
            acc: Optional[list[Any]], residuals: Any, g: Any) -> Any:
        if any(i.ndim == c.ndim + 2
               for i, c in zip(jtu.tree_leaves(residuals[0]), jtu.tree_leaves(g))):
            # The residuals of the batched forward rule (`[L, batch, ...]`): only the
            # rule below computes; this traces once for one example's types.
            return (list(leaves), _zeros_like_inexact(g), _zeros_like_inexact(consts),
                    list(state))
        return scan.backward(leaves, consts, state, shared, acc, residuals, g, None)

    @run.def_vmap
    def _(size: int, in_batched: Any, leaves: list[Any], consts: Any, state: list[Any],
          shared: list[Any], acc: Optional[list[Any]], residuals: Any, g: Any) -> Any:
        b_leaves, b_consts, b_state, b_shared, b_acc, b_residuals, b_g = in_batched
        _check_unbatched([b_leaves, b_state, b_shared, b_acc, b_residuals])
        new_leaves, g_x, g_consts, new_state = scan.backward(
            leaves, consts, state, shared, acc, residuals, _broadcast(g, b_g, size),
            b_consts)
        flags = (_all(new_leaves, False), _all(g_x, True),
                 jtu.tree_map(_flag_unless_none, g_consts, b_consts,
                              is_leaf=is_none),
                 _all(new_state, False))
        return (new_leaves, g_x, g_consts, new_state), flags

    return run


def update_scan(leaves: list[Any], x: Any, layer_call: Callable[[list[Any], Any], Any],
                hook: Hook, save_input: Optional[Callable[[Any], Any]], unroll: int) -> Any:
    """The output of the last layer of the stack `leaves` (flat stacked weight leaves)
    run from `x` by `layer_call(layer_leaves, carry)`; differentiated with respect to
    `hook.leaves` and `hook.state`, its "cotangents" are the new weights and state
    (see the module's docstring). `leaves` may differ from `hook.leaves` only by moves
    (small host leaves brought to the device whole, by `scan_layers`)."""
    example = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in leaves]
    converted = eqx.filter_closure_convert(layer_call, example, x)
    consts, conv_static = eqx.partition(converted, eqx.is_array)
    scan = UpdateScan([is_host(a) for a in leaves], leaves[0].shape[0], conv_static,
                      save_input, unroll, hook.update,
                      [stacked_packed_vector(s) for s in hook.state])
    forward_only, forward_saving = _forward_pass(scan, False), _forward_pass(scan, True)
    backward = _backward_pass(scan)

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
                shared: list[Any], acc: Optional[list[Any]], stored: Optional[list[Any]]) -> Any:
        del perturbed
        leaves, x, consts, views = vjp_arg
        g = jtu.tree_map(_cotangent, g, x, is_leaf=is_none)
        weights, g_x, g_consts, state = backward(
            leaves, consts, views if stored is None else stored, shared, acc, residuals, g)
        return weights, g_x, g_consts, [_view(s, v.dtype) for s, v in
                                        zip(state, views, strict=True)]

    rules: Any = run  # (Equinox's `def_fwd`/`def_bwd` are untyped)
    rules.def_fwd(run_fwd)
    rules.def_bwd(run_bwd)
    hook.calls += 1
    out: Any = run((leaves, x, consts, hook.state), hook.shared, hook.accumulated, hook.stored)
    return out


def _view(a: Any, dtype: Any) -> Any:
    """`a`'s bits as `dtype` (`a` itself where of that dtype)."""
    return a if a.dtype == dtype else jax.lax.bitcast_convert_type(a, dtype)

"""The update inside the backward pass: the layer scan (`layers.py`) with a backward
pass that updates each layer as it makes its gradient.

The backward scan, from the last layer down, recomputes layer `i`'s VJP, hands its
gradient, its weights and its slice of the optimizer state to the `update` it was
given, and writes the new weights and state into their stacked arrays at `i` (in
place: the arrays are the loop's carry, so XLA updates the donated buffers). What the
layer scan's custom VJP returns as the "cotangents" of the weights and of the state are
these new arrays: the caller (`_models/backward.py`) differentiates the loss with
respect to them and reads the new model and state off the gradient. The whole gradient
of the layers never exists: each layer's is consumed by its update in the iteration
that makes it.

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
import functools
from collections.abc import Callable, Iterator
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._core.compat import marked, optimization_barrier
from .._core.leaves import is_none
from .._core.move import send_to_host
from .._core.placement import is_host, stacked_packed_vector
from .layers import (
    add_unless_none, fetch, fetch_layer, layer_scan, layer_slice, LayerScan, merge,
    zeros_like_inexact,
)


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


def _write(a: Any, i: Any, piece: Any) -> Any:
    """`a` with `piece` (leading axis 1) written at layer `i`."""
    return jax.lax.dynamic_update_slice(a, piece, (i,) + (0,) * (a.ndim - 1))


def _update_layer(update: Update, todo: Any, shared: list[Any]) -> Any:
    """The update stage: `todo` (`(i, gradient, weights, state slices)` of layer `i`) as
    `(i, new weights, new state slices on the device)`."""
    i, g_layer, layer, state_slices = todo
    new_layer, new_state = update(g_layer, layer, state_slices, shared)
    return i, new_layer, fetch(new_state)


def _backward(update: Update, whole: list[bool], scan: LayerScan, leaves: list[Any],
              consts: Any, state: list[Any], shared: list[Any], acc: Optional[list[Any]],
              residuals: Any, g: Any, batched: Any) -> Any:
    """The backward pass of `scan` with `update` in it (`whole`: per state leaf, updated
    on the device whole: see `update_scan`). From the last layer down, a pipeline of
    three stages per iteration `i`: layer `i`'s VJP (while layer `i - 1`'s host weights
    and layer `i`'s state come to the device), the update of layer `i + 1` (with the
    gradient and the state the iteration before fetched: it runs beside the VJP), and
    the write of layer `i + 2`'s new weights and state into the stacked arrays (the
    loop's carry). The top two layers' iterations, with nothing to write yet, are
    loops of their own: the top layer's VJP alone (`first`, with that layer's state,
    sliced before it, in its `todo`), then the next layer's VJP beside the top layer's
    update (`second`): no iteration moves a layer that is not updated, and each layer's
    state is read once (`_loops`). The last two stages of the first layer run after the
    loops. Returns `(new weights, cotangent of x, cotangents of consts, new state)`.
    Layer `i`'s state is read before layer `i + 2`'s is written (`_exchanged`): the
    state's copies to the device and to host run at once.

    The stages are apart so that each update is its own computation on whole operands,
    as in the normal step: XLA:CPU compiles an update fused into the slices it reads or
    the `dynamic-update-slice` it is written by without the normal step's fused
    multiply-adds, so it would round otherwise."""
    inputs, last = residuals
    top = scan.length - 1
    weights = list(leaves)
    state = [fetch(s) if w else s for s, w in zip(state, whole, strict=True)]

    def layer_vjp(i: Any, g: Any, current: list[Any], g_consts: Any, weights: list[Any],
                  state_slices: list[Any]) -> Any:
        # The cotangent of layer i's input, layer i - 1's fetched host weights, the
        # consts' cotangents summed, and the update's inputs (layer i's gradient, its
        # state: `state_slices`).
        host_weights, device_weights = scan.split(weights)
        preceding = fetch_layer(host_weights, jnp.maximum(i - 1, 0))
        device_slices = [jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
                         for a in device_weights]
        layer = merge(current, device_slices, scan.on_host)
        h = jtu.tree_map(functools.partial(_layer_of, i=i), inputs)  # (as `lax.scan` slices)
        g_layer, g_h, g_c = scan.layer_vjp(i, g, layer, h, consts, batched)
        if acc is not None:  # the sum of the earlier micro-batches, plus this one's
            g_layer = [jax.lax.dynamic_index_in_dim(a, i, keepdims=False) + d
                       for a, d in zip(acc, g_layer, strict=True)]
        todo = (i, [a[None] for a in g_layer], [a[None] for a in layer], state_slices)
        g_consts = jtu.tree_map(add_unless_none, g_consts, g_c, is_leaf=is_none)
        return g_h, preceding, g_consts, todo

    def stages(i: Any, g: Any, current: list[Any], g_consts: Any, weights: list[Any],
               slices: list[Any], todo: Any) -> Any:
        # An iteration's update (of `todo`) and VJP (of layer i).
        done = _update_layer(update, todo, shared)
        return (*layer_vjp(i, g, current, g_consts, weights, slices), done)

    def first(carry: Any, i: Any) -> tuple[Any, None]:
        g, current, g_consts, (_, _, _, slices) = carry
        return layer_vjp(i, g, current, g_consts, weights, slices), None

    def second(carry: Any, i: Any) -> tuple[Any, None]:
        g, current, g_consts, todo, _ = carry
        return stages(i, g, current, g_consts, weights, _state_slices(state, whole, i),
                      todo), None

    def body(carry: Any, i: Any) -> tuple[Any, None]:
        g, current, g_consts, weights, state, todo, done = carry
        weights = _write_layer(weights, done[0], done[1])
        state, slices = _exchanged(state, whole, i, done)
        g_h, preceding, g_consts, todo, done = stages(i, g, current, g_consts, weights,
                                                      slices, todo)
        return (g_h, preceding, g_consts, weights, state, todo, done), None

    g_consts = zeros_like_inexact(eqx.filter(consts, eqx.is_inexact_array))
    pieces = [_zeros_layer(a) for a in leaves]
    todo = (top, pieces, pieces, _state_slices(state, whole, top))
    g, g_consts, weights, state, todo, done = _loops(
        first, second, body, (g, last, g_consts, todo), weights, state, top, scan.unroll)
    weights, state = _last_two(update, shared, whole, weights, state, todo, done)
    return weights, g, g_consts, state


def _loops(first: Callable[[Any, Any], Any], second: Callable[[Any, Any], Any],
           body: Callable[[Any, Any], Any], carry: Any, weights: list[Any],
           state: list[Any], top: int, unroll: int) -> Any:
    """The backward pass's loops, from `carry` (`(g, last, g_consts, todo)`): `first`
    (the top layer, `top`), `second` (the next) and `body` (the rest but the first
    layer). Returns `(g, g_consts, weights, state, todo, done)` (`done`: `None` for one
    layer). Each loop's carry holds what it makes, so `todo` and `done` go in as zeros
    of their types, never read, but for `todo`'s state slices: the top layer's, which
    `first` passes on (a host array of zeros breaks XLA:TPU's compile)."""
    g, current, g_consts, todo = _down(first, carry, top, top + 1)
    if top == 0:
        return g, g_consts, weights, state, todo, None
    done = (top, carry[3][1], [_zeros_layer(s) for s in state])
    g, current, g_consts, todo, done = _down(
        second, (g, current, g_consts, todo, done), top - 1, top)
    if top > 1:
        g, _, g_consts, weights, state, todo, done = _down(
            body, (g, current, g_consts, weights, list(state), todo, done), 0, top - 1,
            unroll)
    return g, g_consts, weights, state, todo, done


def _last_two(update: Update, shared: list[Any], whole: list[bool], weights: list[Any],
              state: list[Any], todo: Any, done: Any) -> tuple[list[Any], list[Any]]:
    """`weights` and `state` with the pipeline's last two stages written: `done` (layer
    1's update, where there is one) and the update of `todo` (layer 0's); each `whole`
    state leaf back to host."""
    if done is not None:
        weights, state = _written(weights, state, done)
    last_update = _apart(lambda todo: _update_layer(update, todo, shared), todo)
    weights, state = _written(weights, state, last_update)
    return weights, [send_to_host(s) if w else s for s, w in zip(state, whole, strict=True)]


def _zeros_layer(a: Any) -> Any:
    """Zeros of one layer of the stacked `a` (leading axis 1)."""
    return jnp.zeros((1,) + a.shape[1:], a.dtype)


def _layer_of(a: Any, i: Any) -> Any:
    """Layer `i` of the stacked `a` on the device (`fetch_layer`)."""
    return fetch_layer([a], i)[0]


def _down(body: Callable[[Any, Any], tuple[Any, None]], carry: Any, start: int, stop: int,
          unroll: int = 1) -> Any:
    """`carry` after `body(carry, i)` for `i` from `stop - 1` down to `start`, in a loop
    (of one iteration too: XLA would inline a `lax.scan` of one, compiled apart from the
    loops' bodies, with other roundings; its trip count is hidden from it)."""
    if stop - start != 1:
        return jax.lax.scan(body, carry, jnp.arange(start, stop), reverse=True,
                            unroll=unroll)[0]
    hidden = optimization_barrier(jnp.int32(start))

    def once(_: Any, carry: Any) -> Any:
        return body(carry, hidden)[0]

    return jax.lax.fori_loop(hidden, hidden + 1, once, carry)


def _apart(update: Callable[[Any], Any], todo: Any) -> Any:
    """`update(todo)` under a conditional: otherwise XLA:CPU fuses the last layer's update
    into the write of its result (an optimization barrier does not survive its passes)
    and contracts its multiply-adds otherwise than the normal step."""
    return jax.lax.cond(todo[0] >= 0, update, update, todo)


def _state_slices(state: list[Any], whole: list[bool], i: Any) -> list[Any]:
    """Layer `i`'s slice of each state leaf, in host memory (a `whole` one, on the
    device, sliced there and moved)."""
    return [send_to_host(layer_slice(s, i)) if w else layer_slice(s, i)
            for s, w in zip(state, whole, strict=True)]


def _written(weights: list[Any], state: list[Any], done: Any) -> tuple[list[Any], list[Any]]:
    """`weights` and `state` with the layer `done` holds (`(i, layer, state slice)`,
    each leaf with a leading axis of 1) written at `i`."""
    i, layer, slices = done
    return _write_layer(weights, i, layer), _write_layer(state, i, slices)


def _write_layer(stacks: list[Any], i: Any, pieces: list[Any]) -> list[Any]:
    """`stacks` with `pieces` (one layer's leaves, leading axis 1) written at layer `i`."""
    return [_write(a, i, send_to_host(p) if is_host(a) else p)
            for a, p in zip(stacks, pieces, strict=True)]


def _exchanged(state: list[Any], whole: list[bool], i: Any,
               done: Any) -> tuple[list[Any], list[Any]]:
    """`state` with the layer `done` holds written (as `_written`), and layer `i`'s
    state slices (as `_state_slices`), each read before its leaf's write: no fetch
    waits for a write into its own leaf, so the copies to the device and to host run
    at once (a read then a write of one host leaf, in place, take turns: the write
    waits for the read, behind an optimization barrier, with no copy of the leaf). No
    fetch waits for another leaf's write: XLA:TPU then keeps the link busier both ways
    (a fetch that waited for the write four leaves before it planned a slower step)."""
    j, _, pieces = done
    new_state, slices = list[Any](), list[Any]()
    for s, w, p in zip(state, whole, pieces, strict=True):
        if w:
            slices.append(send_to_host(layer_slice(s, i)))
            new_state.append(_write(s, j, p))
            continue
        s, piece = optimization_barrier((s, layer_slice(s, i)))
        slices.append(piece)
        new_state.append(_write(s, j, send_to_host(p) if is_host(s) else p))
    return new_state, slices


def update_scan(dynamic: Any, static: Any, x: Any, call: Callable[[Any, Any], Any],
                hook: Hook, save_input: Optional[Callable[[Any], Any]], unroll: int,
                batched_layers: str) -> Any:
    """The output of the last of the stacked layers `(dynamic, static)` run from `x` by
    `call(layer, carry)`; differentiated with respect to `hook.leaves` and
    `hook.state`, its "cotangents" are the new weights and state (see the module's
    docstring). `dynamic`'s leaves may differ from `hook.leaves` only by moves (small
    host leaves brought to the device whole, by `scan_layers`).

    A state leaf is updated on the device whole (fetched before the backward scan, back
    to host after it) where a TPU cannot slice a layer of it in host memory (a bf16
    moment of a norm scale: `stacked_packed_vector`), as the layer scan does with such
    weights; they are small. The update is still handed host slices of them."""
    whole = [stacked_packed_vector(s) for s in hook.state]
    hook.calls += 1
    return layer_scan(dynamic, static, x, call, save_input, unroll, batched_layers,
                      hook.accumulated, hook.state, hook.shared,
                      functools.partial(_marked_backward, hook.stored is None, hook.update,
                                        whole), hook.stored)


def _marked_backward(mark: bool, *args: Any) -> Any:
    """`_backward`, with `mark` marked for `filter_jit` (`compat.scopes`: its options for
    a TPU). Not for state stored in another dtype (8-bit): the time model plans that
    step slower with them."""
    with marked("in_backward") if mark else contextlib.nullcontext():
        return _backward(*args)

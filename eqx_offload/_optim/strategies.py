"""The update strategies of `offloaded`, behind one signature in Optax's shape:

    strategy(call, updates, state, params=None, **extra_args)
        -> (updates, new_inner_state)

`updates`, `params` and `**extra_args` are `update`'s own; `state` is the inner state as
stored (host leaves included); `call` (a `Call`) holds the facts of the call: the inner
transformation, the state's layout and whether any argument is traced. Each strategy
brings the state it needs to the device (`Layout.fetch`, or the engine's transfers
group by group), runs `inner.update`, and returns the new inner state; `offloaded`'s
update then stores it (`Layout.store`).

- `auto_update` (default, `group_bytes="auto"`): streamed under `jit` for an
  accelerator where the update allows it, else `update_on_device` (chosen by
  `by_platform`: before tracing where `filter_jit` knows the platform, else by
  `platform_dependent`);
- `update_on_device` (`group_bytes=None`): the whole state at once;
- `streamed` (`group_bytes=N`): the engine's `streamed_update` (`_stream/update`);
- `host` (`compute="host"`): the engine's `host_update`.

Called eagerly, the default and `group_bytes=None` run op by op, bitwise as
`inner.update` called eagerly. The streamed and host-compute updates are properties of
one compiled program, so eagerly they run compiled (through `eqx_offload.filter_jit`),
bitwise as `jax.jit(inner.update)`.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.tree_util as jtu
import optax

from .._core.compat import marked, optimization_barrier
from .._core.errors import NotStreamable
from .._core.move import place_like
from .._core.placement import any_on_host, is_host
from .._core.where import leaf_mask
from .._jit.jit import filter_jit
from .._jit.stage import lowering_platforms
from .._stream import host_update, streamed_update, Transfers
from .layout import fetch, Layout, narrowed, store, widened_dtype
from .options import Options


class Call(NamedTuple):
    """The facts of one `update` call that a strategy works under (not its inputs).

    **Fields:**

    - `inner`: the inner transformation.
    - `layout`: the inner state's layout (which leaves live in host memory, how they
        cross).
    - `traced`: whether any argument of the call is traced.
    """

    inner: optax.GradientTransformationExtraArgs
    layout: Layout
    traced: bool


@runtime_checkable
class Strategy(Protocol):
    """An update strategy: brings what it needs of the inner state `state` (laid out
    as `call.layout` says) to the device, runs `call.inner.update` on `updates`, and
    returns `(updates, new_inner_state)`, the new state not yet stored. Optax's
    `update(updates, state, params=None, **extra_args)` with the call's facts first."""

    def __call__(self, call: Call, updates: Any, state: Any, params: Any = None, /,
                 **extra_args: Any) -> tuple[Any, Any]:
        ...


def update_on_device(call: Call, updates: Any, state: Any, params: Any = None, /,
                     **extra_args: Any) -> tuple[Any, Any]:
    """The whole state to the device, then `inner.update`, in one program with no
    ordering of its own. Under `filter_jit` for a GPU, a state with leaves in host
    memory makes the step compile with `stage.GPU_WHOLE_STATE_OPTIONS`, so
    that XLA's scheduler does not start every copy before the forward pass. No barrier orders the
    copies after the gradients: one changes how XLA's CPU backend fuses a bias's
    gradient reduction, and with it the last bits of the result."""
    layout, leaves = call.layout, jtu.tree_leaves(state)
    if call.traced and any_on_host(leaves):
        with marked("whole"):  # (read by `filter_jit`: `compat.scopes`)
            leaves = _after_gradients(leaves, updates)
            fetched = layout.fetch(leaves)
    else:
        fetched = layout.fetch(leaves)
    result: tuple[Any, Any] = call.inner.update(updates, layout.unflatten(fetched), params,
                                                **extra_args)
    return result


def _after_gradients(leaves: list[Any], updates: Any) -> list[Any]:
    """On an accelerator, `leaves` (still on host) wait for every gradient: the state
    comes to the device once the backward pass is done. Unordered, XLA:TPU (JAX 0.10.2)
    started the copies during the forward pass and, with the device memory short, the
    step's losses went wrong (docs: "Modes"). On the CPU (one RAM) nothing waits: a
    fence there would change how XLA fuses the gradients, and the last bits. The
    gradients themselves are not fenced: `inner.update` reads them as they are."""
    def fenced(leaves: list[Any], updates: Any) -> list[Any]:
        return list(optimization_barrier((leaves, updates))[0])

    def unfenced(leaves: list[Any], updates: Any) -> list[Any]:
        return leaves

    arrays, values = eqx.partition(leaves, eqx.is_array)  # (not Python values)
    result: list[Any] = eqx.combine(by_platform(unfenced, fenced, arrays, updates), values)
    return result


def by_platform(cpu: Callable[..., Any], accelerator: Callable[..., Any], *args: Any) -> Any:
    """`cpu(*args)` where the program being traced is lowered for the CPU alone,
    `accelerator(*args)` where it is lowered for accelerators alone, the other branch
    not traced (`stage.lowering_platforms`: known under `eqx_offload.filter_jit`, its
    call, `lower_for` and `export`); where the platforms are several or unknown (under
    `jax.jit`), both in one `jax.lax.platform_dependent`, and JAX lowers the one for
    the platform it lowers for. The one chooser of the default's branches: the whole
    state's fence (`_after_gradients`), `auto_update`, and the applying mini-step of
    `offloaded(MultiSteps(...))`."""
    on_cpu = {p == "cpu" for p in lowering_platforms() or ()}
    if on_cpu == {True}:
        return cpu(*args)
    if on_cpu == {False}:
        return accelerator(*args)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=accelerator)


def auto_update(call: Call, updates: Any, state: Any, params: Any = None, /,
                **extra_args: Any) -> tuple[Any, Any]:
    """For an accelerator, `streamed` with an automatic group size, or the whole state
    where the update cannot be streamed (`NotStreamable`: it couples all of the state,
    e.g. `apply_if_finite`, or has side effects). Eagerly, or for the CPU backend (one
    RAM: streaming frees nothing and its barriers cost step time), the whole state at
    once.

    The branch is chosen before tracing where the platforms the program is lowered for
    are known (`stage.lowering_platforms`: under `eqx_offload.filter_jit`, its call,
    `lower_for` and `export`): only the CPU, the whole state; no CPU, the streamed
    update. Where they are not (under `jax.jit`, or for the CPU and an accelerator at
    once) the program holds both, and JAX lowers only the one for the platform it
    lowers for (`jax.lax.platform_dependent`): a step traced with `jax.jit` and lowered
    for `cuda` streams. Every branch returns the same types (`_as_returned`); any error
    but `NotStreamable` comes through: none falls back to the whole state unseen."""
    if not call.traced:
        return update_on_device(call, updates, state, params, **extra_args)
    statics: list[Any] = []  # each branch's non-array leaves (a branch returns arrays)

    def branch(strategy: Strategy) -> Callable[[], Any]:
        def run() -> Any:
            new_updates, new_state = strategy(call, updates, state, params, **extra_args)
            dynamic, static = eqx.partition(
                (_as_returned(new_updates, updates), _as_stored(call.layout, new_state)),
                eqx.is_array)
            statics.append(static)
            return dynamic
        return run

    try:
        dynamic = by_platform(branch(update_on_device), branch(streamed))
    except NotStreamable:  # the documented mode of such an update: the whole state
        return update_on_device(call, updates, state, params, **extra_args)
    result: tuple[Any, Any] = eqx.combine(dynamic, statics[0])
    return result


def _as_returned(new_updates: Any, gradients: Any) -> Any:
    """The updates as both branches of `auto_update` return them: each update whose
    gradient is in host memory (of a weight kept there) in that memory, as the streamed
    update writes those of split leaves while it makes them (`master_weights`' new
    compute weights); every other one where it was made. Paired by position, as the
    streamed update pairs them, where there are as many of each."""
    if len(jtu.tree_leaves(new_updates)) != len(jtu.tree_leaves(gradients)):
        return new_updates
    return place_like(new_updates, gradients)


def _as_stored(layout: Layout, state: Any) -> Any:
    """`state` as both branches of `auto_update` return it (`platform_dependent` wants
    the same types from each): the leaves `Layout.store` selects stored, every other
    array leaf on the device (the streamed update leaves a leaf it does not update, such
    as a step count, where it was)."""
    leaves, treedef = jtu.tree_flatten(layout.store(state))
    mask = layout.mask if treedef == layout.treedef else leaf_mask(
        jtu.tree_unflatten(treedef, leaves), layout.options.where)
    away = [not m and eqx.is_array(x) and is_host(x) for x, m in zip(leaves, mask, strict=True)]
    return jtu.tree_unflatten(treedef, fetch(layout.options, leaves, None, away,
                                             treedef=treedef, targets=layout.targets))


def streamed(call: Call, updates: Any, state: Any, params: Any = None, /,
             **extra_args: Any) -> tuple[Any, Any]:
    """The engine's `streamed_update`, moving state as `layout` does; the `filter_jit`
    being traced compiles with the scheduler options that let its copies overlap
    compute on a GPU."""
    options = call.layout.options
    assert options.group_bytes is not None
    with marked("streamed"):  # (read by `filter_jit`: `compat.scopes`)
        return streamed_update(call.inner, updates, state, params, extra_args,
                               transfers=_transfers(options), group_bytes=options.group_bytes,
                               init_dtypes=call.layout.init_dtypes)


def _transfers(options: Options) -> Transfers:
    """How the engine moves state under these options: `layout`'s transfers, with
    `host_dtype` (the engine orders the crossings; `layout` makes them)."""
    def fetch_leaves(leaves: Sequence[Any], init_dtypes: Sequence[Any]) -> list[Any]:
        return fetch(options, leaves, init_dtypes)

    def narrow(leaves: Sequence[Any], init_dtypes: Sequence[Any]) -> list[Any]:
        return narrowed(options, leaves, init_dtypes)

    def store_leaves(leaves: Sequence[Any]) -> list[Any]:
        return store(options, leaves, "pinned_host")

    def computes_in(dtype: Any, init_dtype: Any) -> Any:
        return widened_dtype(options, dtype, init_dtype)

    return Transfers(fetch_leaves, narrow, store_leaves, computes_in, options.lookahead)


def host(call: Call, updates: Any, state: Any, params: Any = None, /,
         **extra_args: Any) -> tuple[Any, Any]:
    """The engine's `host_update`: `inner.update` on the host CPU."""
    return host_update(call.inner, updates, state, params, extra_args,
                       where=call.layout.options.where)


class _CompiledWhenEager:
    """`strategy` in a trace; called eagerly, `strategy` compiled by `filter_jit` (the
    streamed and host-compute updates are properties of one compiled program)."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.compiled = filter_jit(functools.partial(_traced, strategy))

    def __call__(self, call: Call, updates: Any, state: Any, params: Any = None, /,
                 **extra_args: Any) -> tuple[Any, Any]:
        if call.traced:
            return self.strategy(call, updates, state, params, **extra_args)
        # The state as a tree: `filter_jit` gives each output the sharding of the input
        # whose path ends like its own.
        result: tuple[Any, Any] = self.compiled(call.inner, call.layout, updates, state,
                                                params, extra_args)
        return result


def _traced(strategy: Strategy, inner: optax.GradientTransformationExtraArgs, layout: Layout,
            updates: Any, state: Any, params: Any,
            extra_args: dict[str, Any]) -> tuple[Any, Any]:
    return strategy(Call(inner, layout, True), updates, state, params, **extra_args)


def choose(options: Options) -> Strategy:
    """The strategy for these options."""
    if options.group_bytes == "auto" and options.compute == "device":
        return auto_update
    if options.group_bytes is None and options.compute == "device":
        return update_on_device
    return _CompiledWhenEager(host if options.compute == "host" else streamed)

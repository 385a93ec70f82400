"""`offloaded(optax.MultiSteps(...))`: gradient accumulation whose optimizer state crosses
once per optimizer step.

`optax.MultiSteps.update` runs the inner update at every mini-step and keeps its result
only on the last one (`jnp.where`); wrapped whole, that brings the inner state to the
device and back at every mini-step. Here MultiSteps' own arithmetic runs (its schedule,
accumulation, skip function and counters, read from the `MultiSteps` object), with the
inner update — fetch its state, `inner.update`, store it — inside the applying branch of
a `lax.cond`, so the state moves only on the mini-step that applies it. The state is
MultiSteps' own `MultiStepsState` inside an `OffloadedState`, laid out by `layout` like
any offloaded state: the inner optimizer's selected leaves in host memory; the
accumulator on the device (`accumulator="device"`: 4 bytes a parameter, no traffic) or
in host memory (`"host"`: each mini-step sends its gradients down once and the host CPU
adds them there; the applying step brings the sum up once).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jax import lax

from .._core.shape import check_init_fits_host_pool
from .._core.compat import boundary, host_compute, multi_steps_parts, MultiStepsParts
from .._core.errors import NotStreamable, OptionError
from .._core.leaves import is_traced
from .._core.move import move
from .._core.where import leaf_mask
from .._jit.jit import filter_jit
from .checks import check_is_offloaded, check_trace
from .layout import Cache, fetch, Layout, layout_for, store
from .options import Options
from .state import OffloadedState
from .strategies import by_platform, Call, streamed


Accumulator = Literal["device", "host"]
"""Where `offloaded(MultiSteps(...))` keeps the accumulated gradients between mini-steps."""


def as_multi_steps(inner: Any) -> Optional[optax.MultiSteps]:
    """The `optax.MultiSteps` that `inner` is (or whose `gradient_transformation()` it
    is), else `None`."""
    if isinstance(inner, optax.MultiSteps):
        return inner
    owner = getattr(getattr(inner, "update", None), "__self__", None)
    return owner if isinstance(owner, optax.MultiSteps) else None


def check_accumulator(accumulator: Any, multi: Optional[optax.MultiSteps],
                      options: Options) -> None:
    """An `OptionError` for an `accumulator` that is not `"device"` or `"host"`, or
    `"host"` where no accumulation crosses once (no `MultiSteps`, or a mode that wraps
    the whole `MultiSteps`, whose accumulator is in host memory anyway)."""
    if accumulator not in ("device", "host"):
        raise OptionError(f"offloaded(accumulator={accumulator!r}): pass 'device' or 'host'.")
    if accumulator == "host" and (multi is None or not crosses_once(options)):
        raise OptionError(
            "offloaded(accumulator='host'): drop it, or pass an optax.MultiSteps with the "
            "default compute and group_bytes (docs: \"Gradient accumulation\")."
        )


def crosses_once(options: Options) -> bool:
    """Whether `offloaded(MultiSteps(...))` with these options moves the inner state only
    on the applying mini-step (`compute="host"` and streaming wrap the whole thing)."""
    return options.compute == "device" and options.group_bytes in ("auto", None)


def offloaded_multi_steps(
    multi: optax.MultiSteps, options: Options, accumulator: Accumulator = "device",
) -> optax.GradientTransformationExtraArgs:
    """`offloaded(multi)` with the options `offloaded` normalised: a transformation whose
    state is `OffloadedState(MultiStepsState(...))` and whose inner state moves between
    host and device only on the applying mini-step.

    Its `update`, called on its own, gives `multi`'s state bit for bit (counters, inner
    state, accumulator, skip state) and, on an applying mini-step, `multi`'s updates bit
    for bit. On a mini-step that does not apply it gives `+0.0` everywhere: `multi`
    computes the inner update `u` of the partial sum there and returns `0 * u` (`-0.0`
    where `u < 0`, NaN where `u` is not finite), which needs the inner state on the
    device. Inside a larger jitted step XLA may fuse `multi`'s inner update with what
    follows it, which a branch prevents: the last bit can differ.

    **Arguments:**

    - `multi`: an `optax.MultiSteps`.
    - `options`: `offloaded`'s normalised options; `where` selects among the leaves of
        the `MultiStepsState` (paths such as `inner_opt_state/0/mu/w`); of those, the
        inner optimizer's go to host, and the accumulator's with `accumulator="host"`.
    - `accumulator`: `"device"` (default) or `"host"`.

    **Returns:**

    An `optax.GradientTransformationExtraArgs`.
    """
    parts = multi_steps_parts(multi)
    cache = Cache()  # layouts by the arguments' structure and shapes

    def mask_of(state: optax.MultiStepsState) -> list[bool]:
        return _host_mask(state, options, accumulator)

    def init_to_host(params: Any) -> Any:
        state = multi.init(params)
        return _store(options, state, mask_of(state), "pinned_host")

    jitted_init = filter_jit(init_to_host)

    def init_fn(params: optax.Params) -> OffloadedState:
        if any(is_traced(x) for x in jtu.tree_leaves(params)):
            return OffloadedState(init_to_host(params))
        check_init_fits_host_pool(init_fn, params, "offloaded(MultiSteps(...)).init")
        state = jitted_init(params)
        if options.memory_kind != "pinned_host":  # reachable eagerly only
            state = _store(options, state, mask_of(state), options.memory_kind)
        return OffloadedState(state)

    def update_fn(
        updates: optax.Updates, state: Any, params: Optional[optax.Params] = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, OffloadedState]:
        check_is_offloaded(state)
        layout, leaves, traced = layout_for(multi, options, cache, state, updates, params,
                                            extra_args, mask_of)
        if traced:
            check_trace(layout.treedef, leaves, layout.mask)
        step = _Step(parts, layout, _slice(state.inner_state, "inner_opt_state"),
                     _slice(state.inner_state, "acc_grads"), params, extra_args)
        new_updates, new_state = _update(step, updates, state.inner_state)
        if not traced and options.memory_kind != "pinned_host":
            new_state = layout.store(new_state)  # under `jit` only pinned_host is reachable
        return new_updates, OffloadedState(new_state)

    # Errors leave these with the package's frames hidden (`compat.boundary`).
    return optax.GradientTransformationExtraArgs(boundary(init_fn), boundary(update_fn))


class _Step(NamedTuple):
    """What one call of `update` works with: MultiSteps' parts, the state's layout (its
    mask sliced by the two regions that move) and the arguments the inner update gets."""

    parts: MultiStepsParts
    layout: Layout  # of the whole `MultiStepsState`
    inner: slice  # its leaves of `inner_opt_state`
    acc: slice  # its leaves of `acc_grads`
    params: Any
    extra_args: dict[str, Any]


def _update(step: _Step, updates: Any, state: optax.MultiStepsState) -> tuple[Any, Any]:
    """MultiSteps' update (optax 0.2.8's `MultiSteps.update`, step for step) with the
    inner update in the applying branch, and the accumulator's next value computed
    where the accumulator lives."""
    k_steps = step.parts.every_k_schedule(state.gradient_step)
    skip, skip_state = step.parts.should_skip_update_fn(
        updates, state.gradient_step, step.params)
    if (skip.dtype, skip.shape) != (jnp.bool_, ()):
        raise ValueError(
            "The `should_skip_update_fn` function should return a boolean scalar "
            f"array, but it returned an array of dtype {skip.dtype} and shape "
            f"{skip.shape}"
        )

    def apply(u: Any, st: Any, emit: Any) -> tuple[Any, Any]:
        return _apply(step, u, st, emit)

    def keep(u: Any, st: Any, emit: Any) -> tuple[Any, Any]:
        return _zeros(zeros), st.inner_opt_state

    def updates_of(u: Any, st: Any) -> Any:
        return apply(u, st, jnp.bool_(True))[0]

    zeros = jax.eval_shape(updates_of, updates, state)

    def do_update(updates: Any, state: optax.MultiStepsState) -> tuple[Any, Any]:
        emit = state.mini_step == (k_steps - 1)
        final, inner_state = lax.cond(emit, apply, keep, updates, state, emit)
        new_state = optax.MultiStepsState(
            mini_step=optax.safe_increment(state.mini_step) % k_steps,
            gradient_step=emit * optax.safe_increment(state.gradient_step)
            + (1 - emit) * state.gradient_step,
            inner_opt_state=inner_state,
            acc_grads=_next_acc_grads(step, updates, state, emit),
            skip_state=skip_state,
        )
        def emitted(u: Any) -> Any:
            return emit * u

        return jax.tree.map(emitted, final), new_state

    def skip_update(updates: Any, state: optax.MultiStepsState) -> tuple[Any, Any]:
        return _zeros(zeros), state._replace(skip_state=skip_state)

    result: tuple[Any, Any] = lax.cond(skip, skip_update, do_update, updates, state)
    return result


def _apply(step: _Step, updates: Any, state: optax.MultiStepsState,
           emit: Any) -> tuple[Any, Any]:
    """The applying mini-step: `inner.update` on the accumulated gradients, with its
    state brought to the device and sent back to host as the default `offloaded`
    update does: streamed in groups when compiled for an accelerator (where the update
    allows it), else the whole state at once (`_whole`), chosen by
    `strategies.by_platform` (the other branch is not traced where the platforms are
    known)."""
    acc_grads = _add(step.parts, _fetch(step, state.acc_grads, step.acc), updates,
                     state.mini_step)
    grads = optax.tree.cast_like(acc_grads, updates)
    if step.layout.options.group_bytes != "auto":
        return _whole(step, grads, state.inner_opt_state, emit)
    layout = dataclasses.replace(
        step.layout, treedef=jtu.tree_structure(state.inner_opt_state),
        mask=step.layout.mask[step.inner], init_dtypes=step.layout.init_dtypes[step.inner])
    old = jtu.tree_leaves(state.inner_opt_state)

    def stream() -> tuple[Any, Any]:
        final, new_state = streamed(Call(step.parts.opt, layout, True), grads,
                                    state.inner_opt_state, step.params, **step.extra_args)
        if [x.dtype for x in jtu.tree_leaves(new_state)] != [x.dtype for x in old]:
            raise NotStreamable("the update changes its state's dtypes")
        return final, new_state  # its host leaves are in host memory again

    def whole() -> tuple[Any, Any]:
        return _whole(step, grads, state.inner_opt_state, emit)

    try:  # the branch of the platforms the program is lowered for, as `auto_update`'s
        result: tuple[Any, Any] = by_platform(whole, stream)
    except NotStreamable:  # an update that couples all of its state: the whole state
        return whole()
    return result


def _whole(step: _Step, grads: Any, inner_state: Any, emit: Any) -> tuple[Any, Any]:
    """The inner update with the whole inner state on the device. It selects with
    `emit` and casts with the same expressions as MultiSteps' update: XLA's CPU backend
    then fuses, and rounds, as it does for MultiSteps."""
    fetched = _fetch(step, inner_state, step.inner)
    final, new_state = step.parts.opt.update(grads, fetched, params=step.params,
                                             **step.extra_args)

    def select(st: Any, nst: Any) -> Any:
        return jnp.astype(jnp.where(emit, nst, st), st.dtype)

    new_state = jax.tree.map(select, fetched, new_state)
    return final, _store(step.layout.options, new_state, step.layout.mask[step.inner],
                         "pinned_host", step.layout.targets)


def _add(parts: MultiStepsParts, acc_grads: Any, updates: Any, n_acc: Any) -> Any:
    """MultiSteps' accumulation of one mini-step's gradients (a running mean or a sum)."""
    def add_one(upd: Any, acc: Any) -> Any:
        return parts.acc_update(upd, acc, n_acc=n_acc)

    return jax.tree.map(add_one, updates, acc_grads)


def _next_acc_grads(step: _Step, updates: Any, state: optax.MultiStepsState,
                    emit: Any) -> Any:
    """The accumulator after this mini-step: this mini-step's gradients added, reset to
    zeros on the applying one. With the accumulator in host memory, one computation on
    the host CPU (`compute_on("device_host")`): the gradients cross once, to host, and
    the sum stays there (two computations would bring the sum back in between)."""
    def next_acc(acc_grads: Any, updates: Any, n_acc: Any, emit: Any) -> Any:
        def reset(ga: Any, stored: Any) -> Any:
            # (in the dtype it is stored in: MultiSteps' `accumulator_dtype`, or where
            # it lives in host memory, `host_dtype`'s)
            return jnp.astype((1 - emit) * ga, stored.dtype)

        return jax.tree.map(reset, _add(step.parts, acc_grads, updates, n_acc), acc_grads)

    acc_mask = step.layout.mask[step.acc]
    if not any(acc_mask):
        return next_acc(state.acc_grads, updates, state.mini_step, emit)
    return _on_host(next_acc, acc_mask, state.acc_grads, updates, state.mini_step, emit)


def _on_host(fn: Callable[..., Any], acc_mask: tuple[bool, ...], acc_grads: Any,
             *others: Any) -> Any:
    """`fn(acc_grads, *others)` computed in host memory by the host CPU: its arguments
    go to host (a host accumulator is there already), and the accumulator leaves that
    `acc_mask` selects stay there (the others come back)."""
    others = tuple(move(x, True, "pinned_host", "accumulator='host'") for x in others)
    acc_grads = move(acc_grads, True, "pinned_host", "accumulator='host'")
    host, device = jax.memory.Space.Host, jax.memory.Space.Device
    spaces = [host if m else device for m in acc_mask]
    treedef = jtu.tree_structure(acc_grads)

    def flat_fn(*args: Any) -> list[Any]:
        return jtu.tree_leaves(fn(*args))

    run = host_compute(flat_fn, compute_type="device_host", out_memory_spaces=spaces)
    return jtu.tree_unflatten(treedef, run(acc_grads, *others))


def _store(options: Options, tree: Any, mask: Any, memory_kind: str,
           targets: Optional[dict[Any, Any]] = None) -> Any:
    """The leaves of `tree` that `mask` selects, narrowed and sent to `memory_kind`."""
    leaves, treedef = jtu.tree_flatten(tree)
    return jtu.tree_unflatten(treedef, store(options, leaves, memory_kind, mask,
                                             treedef=treedef, targets=targets))


def _fetch(step: _Step, tree: Any, region: slice) -> Any:
    """The leaves of `tree` (the `region` of the state) that the layout keeps in host
    memory, brought to the device (and widened where `host_dtype` narrowed them)."""
    leaves, treedef = jtu.tree_flatten(tree)
    mask, dtypes = step.layout.mask[region], step.layout.init_dtypes[region]
    selected = [x for x, m in zip(leaves, mask, strict=True) if m]
    moved = iter(fetch(step.layout.options, selected,
                             [d for d, m in zip(dtypes, mask, strict=True) if m]))
    return jtu.tree_unflatten(treedef, [next(moved) if m else x
                                        for x, m in zip(leaves, mask, strict=True)])


def _zeros(shapes: Any) -> Any:
    return jax.tree.map(_zeros_like_shape, shapes)


def _zeros_like_shape(s: Any) -> Any:
    return jnp.zeros(s.shape, s.dtype)


def _regions(state: optax.MultiStepsState) -> list[str]:
    """Per leaf of a `MultiStepsState`: the name of the field it belongs to."""
    return [name for name, field in zip(state._fields, state, strict=True)
            for _ in jtu.tree_leaves(field)]


def _slice(state: optax.MultiStepsState, name: str) -> slice:
    regions = _regions(state)
    start = regions.index(name) if name in regions else 0
    return slice(start, start + regions.count(name))


def _host_mask(state: optax.MultiStepsState, options: Options,
               accumulator: Accumulator) -> list[bool]:
    """Per leaf of a `MultiStepsState`: whether it lives in host memory between steps
    (selected by `where`, and the inner optimizer's, or the accumulator's on host)."""
    kept = {"inner_opt_state"} | ({"acc_grads"} if accumulator == "host" else set())
    return [selected and region in kept for selected, region in
            zip(leaf_mask(state, options.where), _regions(state), strict=True)]

"""`offloaded(optax.MultiSteps(...))`: gradient accumulation whose optimizer state crosses
once per optimizer step.

`optax.MultiSteps.update` runs the inner update at every mini-step and keeps its result
only on the last one (`jnp.where`); wrapped whole, that brings the inner state to the
device and back at every mini-step. Here MultiSteps' own arithmetic runs (its schedule,
accumulation, skip function and counters, read from the `MultiSteps` object), with the
inner update — fetch its state, `inner.update`, store it — inside the applying branch of
a `lax.cond`, so the state moves only on the mini-step that applies it. The state is
MultiSteps' own `MultiStepsState` inside an `OffloadedState`, with the inner optimizer's
selected leaves in host memory; the accumulator stays on the device (`accumulator=
"device"`: 4 bytes a parameter, no traffic) or lives in host memory (`"host"`: each
mini-step sends its gradients down once and adds them there; the applying step brings
the sum up once).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jax import lax

from ._checkpoint import check_init_fits_host_pool
from ._checks import check_state, check_trace
from ._compat import host_compute, multi_steps_parts, MultiStepsParts
from ._jit import filter_jit
from ._leaves import is_traced
from ._layout import fetch_state, store_leaves
from ._move import move
from ._options import Options
from ._state import OffloadedState
from ._where import leaf_mask


Accumulator = Literal["device", "host"]
"""Where `offloaded(MultiSteps(...))` keeps the accumulated gradients between mini-steps."""


def as_multi_steps(inner: Any) -> Optional[optax.MultiSteps]:
    """The `optax.MultiSteps` that `inner` is (or whose `gradient_transformation()` it
    is), else `None`."""
    if isinstance(inner, optax.MultiSteps):
        return inner
    owner = getattr(getattr(inner, "update", None), "__self__", None)
    return owner if isinstance(owner, optax.MultiSteps) else None


def offloaded_multi_steps(
    multi: optax.MultiSteps, options: Options, accumulator: Accumulator = "device",
) -> optax.GradientTransformationExtraArgs:
    """`offloaded(multi)` with the options `offloaded` normalised: a transformation whose
    state is `OffloadedState(MultiStepsState(...))` and whose inner state moves between
    host and device only on the applying mini-step. Its `update`, called on its own,
    gives `multi`'s state bit for bit (counters, inner state, accumulator, skip state)
    and `multi`'s updates as numbers (on a mini-step that does not apply, zeros, where
    `multi` gives `0 * u` for the inner update `u` of the partial sum: `-0.0` where
    `u < 0`, NaN where `u` is not finite). Inside a larger jitted step XLA may fuse
    `multi`'s inner update with what follows it, which a branch prevents: the last bit
    can differ.

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
    host_options = options if options.memory_kind == "pinned_host" else _pinned(options)

    def init_to_host(params: Any) -> Any:
        state = multi.init(params)
        return _store(host_options, state, _host_mask(state, options, accumulator))

    jitted_init = filter_jit(init_to_host)

    def init_fn(params: optax.Params) -> OffloadedState:
        if any(is_traced(x) for x in jtu.tree_leaves(params)):
            return OffloadedState(init_to_host(params))
        check_init_fits_host_pool(init_fn, params, "offloaded(MultiSteps(...)).init")
        return OffloadedState(_unpinned(options, jitted_init(params), accumulator))

    abstract_states: dict[Any, Any] = {}

    def abstract_state(like: Any) -> Any:
        """What `multi.init` makes for arguments like these (shapes, dtypes), cached."""
        key = jtu.tree_structure(like), tuple(
            (x.shape, x.dtype) for x in jtu.tree_leaves(like))
        if key not in abstract_states:
            abstract_states[key] = eqx.filter_eval_shape(multi.init, like)
        return abstract_states[key]

    def update_fn(
        updates: optax.Updates, state: Any, params: Optional[optax.Params] = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, OffloadedState]:
        abstract = abstract_state(
            eqx.filter(updates if params is None else params, eqx.is_array))
        check_state(state, abstract)
        leaves, treedef = jtu.tree_flatten(state.inner_state)
        check_trace(treedef, leaves, _host_mask(state.inner_state, options, accumulator))
        # The dtypes `init` gives each leaf: what `host_dtype` narrowed is widened back.
        init_dtypes = [getattr(x, "dtype", None) for x in jtu.tree_leaves(abstract)]
        step = _Step(parts, host_options, accumulator, params, extra_args, init_dtypes)
        new_updates, new_state = step.update(updates, state.inner_state)
        return new_updates, OffloadedState(_unpinned(options, new_state, accumulator))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class _Step:
    """One call of `update`: MultiSteps' arithmetic (optax 0.2.8's `MultiSteps.update`,
    step for step) with the inner update in the applying branch."""

    def __init__(self, parts: MultiStepsParts, options: Options, accumulator: Accumulator,
                 params: Any, extra_args: dict[str, Any], init_dtypes: list[Any]) -> None:
        self.parts = parts
        self.options = options
        self.accumulator: Accumulator = accumulator
        self.params = params
        self.extra_args = extra_args
        self.init_dtypes = init_dtypes
        # Per leaf of the inner state and of the accumulator (set by `update`).
        self.inner_dtypes: list[Any] = []
        self.acc_dtypes: list[Any] = []

    def update(self, updates: Any, state: optax.MultiStepsState) -> tuple[Any, Any]:
        k_steps = self.parts.every_k_schedule(state.gradient_step)
        skip, skip_state = self.parts.should_skip_update_fn(
            updates, state.gradient_step, self.params)
        if (skip.dtype, skip.shape) != (jnp.bool_, ()):
            raise ValueError(
                "The `should_skip_update_fn` function should return a boolean scalar "
                f"array, but it returned an array of dtype {skip.dtype} and shape "
                f"{skip.shape}"
            )
        mask = _host_mask(state, self.options, self.accumulator)
        inner, acc = _slice(state, "inner_opt_state"), _slice(state, "acc_grads")
        inner_mask, acc_mask = mask[inner], mask[acc]
        self.inner_dtypes, self.acc_dtypes = self.init_dtypes[inner], self.init_dtypes[acc]
        def apply(u: Any, st: Any, e: Any) -> tuple[Any, Any]:
            return self._apply(u, st, e, inner_mask, acc_mask)

        def keep(u: Any, st: Any, e: Any) -> tuple[Any, Any]:
            return _zeros(zeros), st.inner_opt_state

        def updates_of(u: Any, st: Any) -> Any:
            return apply(u, st, jnp.bool_(True))[0]

        zeros = jax.eval_shape(updates_of, updates, state)

        def do_update(updates: Any, state: optax.MultiStepsState) -> tuple[Any, Any]:
            acc_grads = self._accumulate(updates, state, acc_mask)
            emit = state.mini_step == (k_steps - 1)
            # The applying branch computes from the same operands, with the same
            # expressions, as MultiSteps' update (it adds this mini-step's gradients
            # itself, selects with `emit`, multiplies by it): XLA's CPU backend then
            # fuses, and rounds, as it does for MultiSteps.
            final, inner_state = lax.cond(emit, apply, keep, updates, state, emit)
            new_state = optax.MultiStepsState(
                mini_step=optax.safe_increment(state.mini_step) % k_steps,
                gradient_step=emit * optax.safe_increment(state.gradient_step)
                + (1 - emit) * state.gradient_step,
                inner_opt_state=inner_state,
                acc_grads=self._reset(acc_grads, emit, acc_mask),
                skip_state=skip_state,
            )
            def emitted(ga: Any) -> Any:
                return emit * ga

            return jax.tree.map(emitted, final), new_state

        def skip_update(updates: Any, state: optax.MultiStepsState) -> tuple[Any, Any]:
            return _zeros(zeros), state._replace(skip_state=skip_state)

        result: tuple[Any, Any] = lax.cond(skip, skip_update, do_update, updates, state)
        return result

    def _apply(self, updates: Any, state: optax.MultiStepsState, emit: Any,
               inner_mask: list[bool], acc_mask: list[bool]) -> tuple[Any, Any]:
        """The applying mini-step: the inner state (and a host accumulator) to the
        device, `inner.update` on the accumulated gradients, the new inner state to
        host."""
        state = state._replace(acc_grads=_fetch(
            self.options, state.acc_grads, acc_mask, self.acc_dtypes))
        acc_grads = self._accumulate(updates, state, [False] * len(acc_mask))
        fetched = _fetch(self.options, state.inner_opt_state, inner_mask, self.inner_dtypes)
        final, new_state = self.parts.opt.update(
            optax.tree.cast_like(acc_grads, updates), fetched, params=self.params,
            **self.extra_args)
        def select(st: Any, nst: Any) -> Any:
            return jnp.astype(jnp.where(emit, nst, st), st.dtype)

        new_state = jax.tree.map(select, fetched, new_state)
        return final, _store(self.options, new_state, inner_mask)

    def _accumulate(self, updates: Any, state: optax.MultiStepsState, acc_mask: list[bool]) -> Any:
        def add(acc_grads: Any, updates: Any, n_acc: Any) -> Any:
            def add_one(upd: Any, acc: Any) -> Any:
                return self.parts.acc_update(upd, acc, n_acc=n_acc)

            return jax.tree.map(add_one, updates, acc_grads)

        if not any(acc_mask):
            return add(state.acc_grads, updates, state.mini_step)
        return _on_host(add, acc_mask, state.acc_grads, updates, state.mini_step)

    def _reset(self, acc_grads: Any, emit: Any, acc_mask: list[bool]) -> Any:
        dtype = self.parts.accumulator_dtype

        def reset(acc_grads: Any, emit: Any) -> Any:
            def reset_one(ga: Any) -> Any:
                return jnp.astype((1 - emit) * ga, dtype)

            return jax.tree.map(reset_one, acc_grads)

        if not any(acc_mask):
            return reset(acc_grads, emit)
        return _on_host(reset, acc_mask, acc_grads, emit)


def _on_host(fn: Callable[..., Any], acc_mask: list[bool], acc_grads: Any,
             *others: Any) -> Any:
    """`fn(acc_grads, *others)` computed in host memory by the host CPU (`compute_on(
    "device_host")`): its array arguments go to host (a host accumulator is there
    already; gradients cross once), and the accumulator leaves `acc_mask` selects stay
    there (the others come back)."""
    others = tuple(move(x, True, "pinned_host", "accumulator='host'") for x in others)
    acc_grads = move(acc_grads, True, "pinned_host", "accumulator='host'")
    host, device = jax.memory.Space.Host, jax.memory.Space.Device
    spaces = [host if m else device for m in acc_mask]
    leaves, treedef = jtu.tree_flatten(acc_grads)
    def flat_fn(*args: Any) -> list[Any]:
        return jtu.tree_leaves(fn(*args))

    run = host_compute(flat_fn, compute_type="device_host", out_memory_spaces=spaces)
    return jtu.tree_unflatten(treedef, run(acc_grads, *others))


def _store(options: Options, tree: Any, mask: list[bool]) -> Any:
    """The leaves of `tree` that `mask` selects, narrowed and sent to host."""
    leaves, treedef = jtu.tree_flatten(tree)
    return jtu.tree_unflatten(
        treedef, store_leaves(options, leaves, mask, options.memory_kind, treedef))


def _fetch(options: Options, tree: Any, mask: list[bool], init_dtypes: list[Any]) -> Any:
    """The leaves of `tree` that `mask` selects, brought to the device (and widened to
    their `init_dtypes` where `host_dtype` narrowed them)."""
    leaves, treedef = jtu.tree_flatten(tree)
    moved = iter(fetch_state(options, [x for x, m in zip(leaves, mask, strict=True) if m],
                             [d for d, m in zip(init_dtypes, mask, strict=True) if m]))
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


def _unpinned(options: Options, state: Any, accumulator: Accumulator) -> Any:
    """Eagerly, with `memory_kind="unpinned_host"`: the host leaves moved there (under
    `jit` only `pinned_host` can be reached, so the program stores there)."""
    if options.memory_kind == "pinned_host" or any(map(is_traced, jtu.tree_leaves(state))):
        return state
    return _store(options, state, _host_mask(state, options, accumulator))


def _pinned(options: Options) -> Options:
    return dataclasses.replace(options, memory_kind="pinned_host")

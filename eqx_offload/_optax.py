"""`offloaded`: an optax transformation whose state lives in host memory between steps.

`offloaded` normalises its inputs once (`_options.normalise`) and chooses its update
strategy once. A strategy is a module-level function with one signature,

    strategy(inner, options, updates, inner_state, params, extra_args, init_dtypes)
        -> (updates, new_inner_state)

that brings the state it needs to the device (`_move.fetch_state`), runs `inner.update`,
and returns the new inner state; `update` then sends the selected leaves to host
(`_move.store_state`). The strategies: `auto_update` (default, `group_bytes="auto"`: the
streamed update under `jit` for an accelerator where the update allows it, else
`update_on_device`),
`update_on_device` (`group_bytes=None`: the whole state at once),
`_stream.streamed_update` (`group_bytes=N`) and `_host_compute.host_update`
(`compute="host"`).

Eager semantics: called outside `jit`, the default and `group_bytes=None` updates run
op by op, like the unwrapped optimizer, so their results are bitwise those of
`inner.update` called eagerly.
The streamed and host-compute updates are properties of one compiled program (op by op
they would bound nothing, and `compute_on` only exists compiled), so eagerly they run
compiled, through `eqx_offload.filter_jit`; their results are those of
`jax.jit(inner.update)`.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, Optional, Union

import equinox as eqx
import jax.extend.core as jex
import jax.tree_util as jtu
import optax

from ._checkpoint import check_init_fits_host_pool
from ._deviceless import target_platform
from ._errors import CompositionError, StateError
from ._inner import as_transformation
from ._host_compute import host_update
from ._jit import filter_jit, foreign_donation, note_streamed
from ._leaves import is_traced
from ._move import fetch_state, store_state
from ._options import Compute, normalise, Options
from ._placement import is_host
from ._state import (abstract_signature, check_state, eval_shape, first_line,
                     first_on_device, OffloadedState, reshaped_leaf, warn_if_on_device)
from ._stream import streamed_update
from ._types import HostMemoryKind, Where
from ._where import leaf_mask, min_ndim, pattern, select


DEFAULT_WHERE = min_ndim(1) & ~pattern(r"(.*/)?grad(/.*)?")  # (line searches' `grad` on the device)

Strategy = Callable[..., tuple[Any, Any]]


def _check_no_foreign_donation(inner_state: Any) -> None:
    """A `CompositionError` where a host-resident state is traced for a jit that donates
    without memory-kind-aware output shardings (`nnx.jit(..., donate_argnums=...)`,
    `eqx.filter_jit(donate=...)`, `jax.jit(..., donate_argnums=...)`): JAX would pair a
    donated input with an output of the same shape and dtype in the other memory, and
    XLA abort the process at the call. Raised while tracing: nothing has run, nothing
    is donated."""
    if not any(is_host(x) for x in jtu.tree_leaves(inner_state)):
        return
    name = foreign_donation()
    if name is None:
        return
    raise CompositionError(
        f"offloaded(...).update is traced for a jit that donates ({name}): "
        "`nnx.jit(..., donate_argnums=...)`, `eqx.filter_jit(donate=...)` and "
        "`jax.jit(..., donate_argnums=...)` hand JAX no output shardings with memory "
        "kinds, so JAX pairs each donated input with the first output of the same shape "
        "and dtype, whatever its memory; where it pairs this host-memory state with a "
        "device output (or a device input with this state), XLA aborts the process "
        "(\"PjRtBuffer's memory kind does not match sharding's memory kind\"). Nothing "
        "has run and nothing was donated. Donate with `eqx_offload.filter_jit(step, "
        "donate=\"all\")` (Flax NNX: the functional API, `nnx.split` / `nnx.merge` in a "
        "step under `eqx_offload.filter_jit`; see the Flax NNX docs page), or drop the "
        "donation."
    )


def update_on_device(
    inner: optax.GradientTransformationExtraArgs, options: Options, updates: Any,
    inner_state: Any, params: Any, extra_args: dict[str, Any], init_dtypes: Sequence[Any],
) -> tuple[Any, Any]:
    """The whole-state strategy (`group_bytes=None`, and `"auto"` where the update is
    not streamed): the whole state to the device, then `inner.update`, in one program
    with no ordering of its own. Under `filter_jit` for a GPU, a state with leaves in
    host memory makes the step compile with `_jit.GPU_WHOLE_STATE_OPTIONS`, under
    which XLA's scheduler no longer starts every copy before the forward pass
    (`_jit.default_compiler_options`). No barrier orders the copies after the
    gradients: a barrier with the gradients, even one whose copies of them are not
    used, changes how XLA's CPU backend fuses a bias's gradient reduction, and with
    it the last bits of the result."""
    leaves, treedef = jtu.tree_flatten(inner_state)
    if any(is_traced(x) and is_host(x) for x in leaves):
        note_streamed("whole")
    state = jtu.tree_unflatten(treedef, fetch_state(options, leaves, init_dtypes))
    return inner.update(updates, state, params, **extra_args)


def auto_update(
    inner: optax.GradientTransformationExtraArgs, options: Options, updates: Any,
    inner_state: Any, params: Any, extra_args: dict[str, Any], init_dtypes: Sequence[Any],
) -> tuple[Any, Any]:
    """The default strategy (`group_bytes="auto"`): under `jit` for an accelerator, the
    streamed update with an automatic group size, or the whole state at once where the
    update cannot be streamed (it couples all of the state, e.g. `apply_if_finite`, or
    has side effects). Called eagerly, or compiled for the CPU backend (where device and
    host memory are the same RAM, so streaming frees nothing and its barriers cost step
    time: 1.12-1.17x the step without offload at 34M-100M parameters, against
    0.94-1.04x for the whole state), the whole state at once, as `group_bytes=None`."""
    arguments = (updates, inner_state, params, extra_args)
    if target_platform() != "cpu" and any(map(is_traced, jtu.tree_leaves(arguments))):
        try:
            return streamed(inner, options, *arguments, init_dtypes)
        except CompositionError:
            pass
    return update_on_device(inner, options, *arguments, init_dtypes)


def streamed(
    inner: optax.GradientTransformationExtraArgs, options: Options, updates: Any,
    inner_state: Any, params: Any, extra_args: dict[str, Any], init_dtypes: Sequence[Any],
) -> tuple[Any, Any]:
    """The streamed strategy (`group_bytes=N`, and `"auto"` where it streams):
    `_stream.streamed_update`, and the `filter_jit` being traced compiles with the
    scheduler options that let its copies overlap compute on a GPU
    (`_jit.default_compiler_options`)."""
    result = streamed_update(inner, options, updates, inner_state, params, extra_args,
                             init_dtypes)
    note_streamed()
    return result


def _choose(options: Options) -> Strategy:
    if options.compute == "host":
        return host_update
    if options.group_bytes == "auto":
        return auto_update
    if options.group_bytes is not None:
        return streamed
    return update_on_device


def offloaded(
    inner: Union[optax.GradientTransformation, optax.MultiSteps],
    where: Where = DEFAULT_WHERE,
    *,
    memory_kind: HostMemoryKind = "pinned_host",
    group_bytes: Union[int, Literal["auto"], None] = "auto",
    lookahead: int = 1,
    compute: Compute = "device",
    host_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation so that its state lives in host memory.

    `init` creates the state directly in host memory (the full state never exists on
    the device). `update` moves the selected state leaves to the device, runs
    `inner.update` there, and moves the new state back; its updates and new state are
    bitwise equal to those of `inner` (unless `host_dtype` is set).

    **Arguments:**

    - `inner`: any `optax.GradientTransformation`, e.g. `optax.adamw(1e-3)` or a whole
        `optax.chain(...)`, or an `optax.MultiSteps`.
    - `where`: which leaves of the inner state to keep in host memory (see `to_host`;
        paths are those of the inner state). Default `eqx_offload.min_ndim(1)`: every
        array except 0-d scalars, so step counters stay on the device (offloading 4
        bytes costs a transfer and saves nothing). `eqx_offload.within_budget` computes
        one that keeps as much state on the device as a budget allows.
    - `memory_kind`: `"pinned_host"` (default) or `"unpinned_host"` (eager use only).
    - `group_bytes`: how the state comes to the device for the update. `"auto"`
        (default): under `jit` for an accelerator (and in `eqx_offload.gpu_plan`),
        streamed (below) in groups of about 1/16 of the
        offloaded state (at most 256 MiB), in the order the backward pass produces
        the gradients, so the state's share of peak device memory is a few groups
        and most of its copies can overlap the backward pass; where the update cannot
        be streamed (it combines the new state of several parameters, as
        `apply_if_finite`, `MultiSteps` or a global norm after a stateful
        transformation do, or it has side effects) the whole state comes at once;
        called eagerly, or compiled for the CPU backend (one RAM: streaming frees
        nothing there and costs step time), the whole state at once. An int `N`:
        always stream, in groups of at most `N` bytes (`0`: one parameter at a time), and raise a
        `CompositionError` at the first `update` for an optimizer that cannot be
        streamed. `None`: the whole state in one update (the smallest program,
        no barriers; on a GPU `eqx_offload.filter_jit` compiles it with XLA's older
        latency estimator, so that its copies do not all start before the forward
        pass; none of them overlaps compute). A parameter's state is split only along the
        layers of a stacked leaf (at least 3 dimensions, an update elementwise along
        them: "Stacked layers" in the "Modes" docs page). See
        `eqx_offload.stream_plan`, `eqx_offload.gpu_plan` and the "Modes" docs page.
    - `lookahead`: when streamed, how many groups come to the device ahead of
        the one being updated (default 1: double buffering, so copies in both
        directions overlap the update; 0: one group at a time, the smallest peak).
    - `compute`: `"device"` (default) or `"host"`: run `inner.update` on the host CPU
        (`compute_on(..., compute_type="device_host")`), so the state never comes to
        the device; gradients go to host and updates come back.
    - `host_dtype`: keep floating state leaves in host memory in this narrower dtype
        (e.g. `jnp.bfloat16`): narrowed on the device before each copy to host and
        widened back to the dtype `inner.init` gives them after each copy to the
        device, halving the bytes that cross for float32 state. **Not bitwise**: the
        state loses precision between steps (see the "Modes" docs page for its
        measured effect on the loss). Default `None`.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose state is an `OffloadedState`.
    Extra arguments to `update` are passed to `inner`.

    **Raises:**

    `OptionError` (an `OffloadError`) for a bad option, `MemoryKindError` for a memory
    kind the device lacks, `NotATransformationError` for an `inner` that is not a
    transformation.

    **Composition:** `offloaded` goes around any transformation or chain, anywhere in
    an `optax.chain`, and inside `masked`, `multi_transform`, `inject_hyperparams`,
    `apply_if_finite` and `optax.contrib.schedule_free` (they only pass its state
    along). `optax.MultiSteps` computes on the state of what it wraps (a `jnp.where`
    between the old and the new inner state), so it belongs *inside*:
    `offloaded(optax.MultiSteps(...))`. The other order computes on host-resident
    arrays (on a GPU, XLA runs that select on the host), and `eqx_offload.filter_jit`
    rejects it with a `CompositionError`. Outermost is always safe, and it also
    offloads the wrapper's own buffers (such as the `MultiSteps` accumulator).

    !!! Example

        ```python
        import jax.numpy as jnp
        import optax
        import eqx_offload

        params = {"w": jnp.ones((3, 3))}
        opt = eqx_offload.offloaded(optax.adamw(1e-3))
        state = opt.init(params)
        assert state.inner_state[0].mu["w"].sharding.memory_kind == "pinned_host"
        updates, state = opt.update(params, state, params)
        ```
    """
    transformation = as_transformation(inner)
    options = normalise(where, memory_kind, group_bytes, lookahead, compute, host_dtype)
    return _Offloaded(transformation, options).as_transformation()


class _Offloaded:
    """One `offloaded(...)` transformation: its inner transformation, its normalised
    options, its strategy, and what it remembers between calls (the abstract initial
    state per argument shapes; whether it has warned)."""

    def __init__(self, inner: optax.GradientTransformationExtraArgs, options: Options) -> None:
        self.inner = inner
        self.options = options
        self.strategy = _choose(options)
        self.abstract_states: dict[Any, Any] = {}
        # Abstract signatures of states that differ from `init`'s but that
        # `inner.update` accepts (see `_check_state`).
        self.accepted: set[Any] = set()
        self.warned = False
        # Under `jit` the moment state is created it is sent to host, so XLA never holds
        # the whole state in device memory at once; `filter_jit` gives each state leaf
        # the sharding of the parameter it mirrors. `unpinned_host` is only reachable
        # eagerly, so for it the jitted part ends at `pinned_host`.
        self.jitted_init = filter_jit(self._init_to_host)
        # Eagerly, the streamed and host-compute strategies run compiled (see the
        # module docstring); under `jit` they only store to `pinned_host`.
        pinned = self.options if options.memory_kind == "pinned_host" else _pinned(options)
        self.jitted_update = filter_jit(functools.partial(self._run_update, pinned))

    def as_transformation(self) -> optax.GradientTransformationExtraArgs:
        # Plain functions, as optax's own transformations have (not bound methods).
        def init_fn(params: optax.Params) -> OffloadedState:
            return self.init(params)

        def update_fn(
            updates: optax.Updates,
            state: optax.OptState,  # an `OffloadedState`, checked by `update`
            params: Optional[optax.Params] = None,
            **extra_args: Any,
        ) -> tuple[optax.Updates, OffloadedState]:
            return self.update(updates, state, params, **extra_args)

        return optax.GradientTransformationExtraArgs(init_fn, update_fn)

    def _init_to_host(self, params: Any) -> Any:
        state = self.inner.init(params)
        mask = leaf_mask(state, self.options.where)
        return self._store(state, mask, "pinned_host")

    def init(self, params: optax.Params) -> OffloadedState:
        if any(is_traced(x) for x in jtu.tree_leaves(params)):
            state = self._init_to_host(params)
        else:
            # On CUDA/ROCm: fail clearly before placing more than XLA's pinned host
            # pool allows (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`).
            check_init_fits_host_pool(self.init, params, "offloaded(...).init")
            state = self.jitted_init(params)
        if self.options.memory_kind != "pinned_host":
            state = self._store(state, leaf_mask(state, self.options.where))
        return OffloadedState(state)

    def _abstract_state(self, updates: Any, params: Any) -> Any:
        """What `inner.init` makes for these arguments (shapes, dtypes), cached."""
        # Arrays only: `init` is given the arrays of a model (`eqx.filter(model,
        # eqx.is_array)`, the README's recipe) while `update` may get the whole model.
        like = eqx.filter(updates if params is None else params, eqx.is_array)
        key = jtu.tree_structure(like), tuple(
            (getattr(x, "shape", None), getattr(x, "dtype", None)) for x in jtu.tree_leaves(like)
        )
        if key not in self.abstract_states:
            # `filter_eval_shape`: a state may hold non-arrays (strings, Python scalars).
            self.abstract_states[key] = eqx.filter_eval_shape(self.inner.init, like)
        return self.abstract_states[key]

    def _check_state(self, state: Any, updates: Any, params: Any,
                     extra_args: dict[str, Any]) -> None:
        """Refuse a state only on a real mismatch; a state this optimizer made, by `init`
        or by `update`, is never refused.

        The common case costs one comparison: the state has the structure and shapes of
        what `inner.init` makes for these params (or, without them, these updates). At
        the first difference the question is what `inner.update` itself does with the
        state: a state it cannot update is refused, naming the difference from `init`'s
        state and the update's own error; one whose leaves it would reshape (a state
        for other parameters that broadcasts) is refused naming the leaf. Otherwise the
        unwrapped optimizer accepts it, and so does this one: the full model as
        `params` (Python scalars among its leaves), a state that `update` grows
        (optax's `monitor`), an aggregator's per-example updates. That answer is
        remembered per abstract signature, so an eager loop traces `inner.update` for
        it once, not every step, and it depends on no earlier call."""
        try:
            check_state(state, self._abstract_state(updates, params))
            return
        except StateError as error:
            if not isinstance(state, OffloadedState):
                raise
            difference = error
        arguments = (updates, state.inner_state, params, extra_args)
        signature = abstract_signature(arguments)
        if signature in self.accepted:
            return
        try:
            new_state = eval_shape(self._updated_state, arguments)
        except Exception as error:  # any failure of the user's optimizer on this state
            raise StateError(
                f"{difference} (`inner.update` cannot run on it either: "
                f"{type(error).__name__}: {first_line(error)})"
            ) from error
        reshaped = reshaped_leaf(state.inner_state, new_state)
        if reshaped is not None:
            path, old, new = reshaped
            raise StateError(
                f"offloaded(...).update(state=...): leaf inner_state/{path} is {old}, but "
                f"`inner.update` makes it {new} from these updates: the state was made "
                "for other parameters. Pass the state made by this transformation's "
                "`init` for these parameters."
            )
        self.accepted.add(signature)

    def _updated_state(self, updates: Any, inner_state: Any, params: Any,
                       extra_args: dict[str, Any]) -> Any:
        return self.inner.update(updates, inner_state, params, **extra_args)[1]

    def _store(self, state: Any, mask: list[bool], memory_kind: Optional[str] = None) -> Any:
        """The leaves of `state` that `mask` selects, narrowed and sent to host."""
        # The flat mask as it is (never rebuilt as a tree and read again as a spec).
        return store_state(self.options, state, select(mask), memory_kind)

    def _run_update(
        self, options: Options, updates: Any, inner_state: Any, params: Any,
        extra_args: dict[str, Any], init_dtypes: Sequence[Any],
    ) -> tuple[Any, Any]:
        return self.strategy(self.inner, options, updates, inner_state, params, extra_args,
                             init_dtypes)

    def update(
        self, updates: optax.Updates, state: Any, params: Optional[optax.Params] = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, OffloadedState]:
        # (`state: Any`: `check_state` names a wrong state better than a type hint.)
        self._check_state(state, updates, params, extra_args)
        inner_state = state.inner_state
        mask = leaf_mask(inner_state, self.options.where)
        if any(map(is_traced, jtu.tree_leaves(inner_state))):
            _check_no_foreign_donation(inner_state)
        if _named_axes():
            on_device = first_on_device(inner_state, mask)
            if on_device is not None:
                raise _device_state_error(on_device)
        if not self.warned:
            self.warned = warn_if_on_device(inner_state, mask, self.options.memory_kind)
        init_dtypes = self._init_dtypes(inner_state, updates, params)
        arguments = (updates, inner_state, params, extra_args)
        if self.strategy in (update_on_device, auto_update) or any(map(is_traced, jtu.tree_leaves(arguments))):
            updates, new_state = self._run_update(self.options, *arguments, init_dtypes)
        else:
            updates, new_state = self.jitted_update(*arguments, init_dtypes)
        new_def: Any = jtu.tree_structure(new_state)  # PyTreeDef: typed without __eq__
        same_tree = new_def == jtu.tree_structure(inner_state)
        new_mask = mask if same_tree else leaf_mask(new_state, self.options.where)
        return updates, OffloadedState(self._store(new_state, new_mask))

    def _init_dtypes(self, inner_state: Any, updates: Any, params: Any) -> list[Any]:
        """Per leaf of the inner state: the dtype `inner.init` gives it (only needed to
        widen what `host_dtype` narrowed; `None` otherwise)."""
        leaves = jtu.tree_leaves(inner_state)
        if self.options.host_dtype is None:
            return [None] * len(leaves)
        abstract = self._abstract_state(updates, params)
        return [getattr(x, "dtype", None) for x in jtu.tree_leaves(abstract)]


def _named_axes() -> tuple[Any, ...]:
    """The named axes of the trace in progress (`pmap`, `shard_map`, `vmap(axis_name=...)`)."""
    names = getattr(jex, "unsafe_get_axis_names_DO_NOT_USE", lambda: ())()
    return tuple(names)


def _device_state_error(path: str) -> CompositionError:
    return CompositionError(
        f"offloaded(...).update: state leaf inner_state/{path} arrived in device memory "
        "inside a transformation with named axes (`pmap`, e.g. `eqx.filter_pmap`, "
        "`shard_map` or `vmap(axis_name=...)`). pmap places every argument in device "
        "memory, so a state kept in host memory cannot pass through it. Use "
        "`eqx_offload.filter_jit` with sharded arguments instead (`eqx.filter_shard` "
        "inside the step, `eqx_offload.filter_shard` outside it; see the \"Multi-device\" "
        "docs page), as JAX recommends over pmap; `jax.shard_map` inside "
        "`eqx_offload.filter_jit` works when the state comes in in host memory."
    )


def _pinned(options: Options) -> Options:
    """`options` storing to `pinned_host`, the only host memory reachable under `jit`."""
    return dataclasses.replace(options, memory_kind="pinned_host")

"""`offloaded`: an optax transformation whose state lives in host memory between steps.

Closures over `inner` and the normalised options, in the manner of Optax's own
wrappers: `init` makes the state in host memory; `update` looks up the state's layout
(`_layout`), runs the strategy the options chose (`_strategies`) and stores the new
state. Checks run only on a layout not seen before, and while tracing (`_checks`).
"""

import functools
from typing import Any, Literal, Optional, Union

import jax.tree_util as jtu
import optax
from jax.core import Tracer

from ._accumulate import as_multi_steps, offloaded_multi_steps
from ._checkpoint import check_init_fits_host_pool
from ._checks import check_is_offloaded, check_trace, first_on_device, warn_on_device
from ._inner import as_transformation
from ._jit import filter_jit
from ._layout import Cache, layout_for, store_tree
from ._options import Compute, normalise, Options
from ._state import OffloadedState
from ._strategies import choose, Strategy
from ._types import HostMemoryKind, Where
from ._where import leaf_mask, min_ndim, warn_if_selects_nothing


DEFAULT_WHERE = min_ndim(1)


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
    multi = as_multi_steps(inner)
    if multi is not None and compute == "device" and group_bytes in ("auto", None):
        # The inner state crosses once per optimizer step (see "Gradient accumulation").
        return offloaded_multi_steps(multi, normalise(
            where, memory_kind, group_bytes, lookahead, compute, host_dtype))
    inner = as_transformation(inner)
    options = normalise(where, memory_kind, group_bytes, lookahead, compute, host_dtype)
    strategy = choose(options)
    cache = Cache()  # layouts by the arguments' structure and shapes
    # Under `jit` the state is sent to host as it is made, so the whole state never is
    # in device memory; `filter_jit` gives each leaf the sharding of its parameter.
    jitted_init = filter_jit(functools.partial(_init_to_host, inner, options))

    def init_fn(params: optax.Params) -> OffloadedState:
        return OffloadedState(_init(inner, options, jitted_init, params))

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,  # an `OffloadedState`, checked by `_update`
        params: Optional[optax.Params] = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, OffloadedState]:
        return _update(inner, options, strategy, cache, updates, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _init_to_host(inner: optax.GradientTransformationExtraArgs, options: Options,
                  params: Any) -> Any:
    return store_tree(options, inner.init(params), "pinned_host")


def _init(inner: optax.GradientTransformationExtraArgs, options: Options, jitted_init: Any,
          params: Any) -> Any:
    if any(isinstance(x, Tracer) for x in jtu.tree_leaves(params)):
        state = _init_to_host(inner, options, params)
    else:
        # On CUDA/ROCm: fail clearly before placing more than XLA's pinned host pool
        # allows (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`).
        check_init_fits_host_pool(functools.partial(_init_to_host, inner, options), params,
                                  "offloaded(...).init")
        state = jitted_init(params)
    warn_if_selects_nothing(state, options.where, leaf_mask(state, options.where),
                            "offloaded(...).init: where", stacklevel=4)
    if options.memory_kind == "pinned_host":
        return state
    # `unpinned_host` is only reachable eagerly: the jitted part ends at `pinned_host`.
    return store_tree(options, state, options.memory_kind)


def _update(
    inner: optax.GradientTransformationExtraArgs, options: Options, strategy: Strategy,
    cache: Cache, updates: Any, state: Any, params: Any, extra_args: dict[str, Any],
) -> tuple[Any, OffloadedState]:
    # (`state: Any`: `check_is_offloaded` names a wrong state better than a type hint.)
    check_is_offloaded(state)
    layout, leaves, traced = layout_for(inner, options, cache, state, updates, params,
                                        extra_args)
    if traced:
        check_trace(layout.treedef, leaves, layout.mask)
    if not cache.warned:  # the cheap part: a memory kind per selected leaf, no walk
        i = first_on_device(leaves, layout.mask)
        if i is not None:
            cache.warned = warn_on_device(layout.treedef, leaves, i, options.memory_kind)
    updates, new_state = strategy(inner, layout, traced, updates, leaves, params, extra_args)
    return updates, OffloadedState(layout.store(new_state))

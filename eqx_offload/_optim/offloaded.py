"""`offloaded`: an optax transformation whose state lives in host memory between steps.

Closures over `inner` and the normalised options, in the manner of Optax's own
wrappers: `init` makes the state in host memory and finds its layout (`layout`);
`update` looks the state's layout up, runs the strategy the options chose
(`strategies`) and stores the new state. Checks run only on a layout not seen before,
and while tracing (`checks`).
"""

import dataclasses
import functools
from typing import Any, Literal, Optional, Union

import equinox as eqx
import jax.tree_util as jtu
import optax
from jax.core import Tracer

from .accumulate import (
    Accumulator, as_multi_steps, check_accumulator, crosses_once, offloaded_multi_steps,
)
from .._core.compat import boundary
from .._core.shape import check_init_fits_host_pool
from .._core.inner import as_transformation
from .._core.types import HostMemoryKind, Where
from .._core.where import leaf_mask, min_ndim, pattern, warn_if_selects_nothing
from .._jit.jit import filter_jit
from .checks import (
    check_is_offloaded, check_not_deleted, check_state_not_deleted, check_trace,
    first_on_device, warn_on_device,
)
from .layout import Cache, layout_for, store_tree
from .options import Compute, normalise, Options
from .state import OffloadedState
from .strategies import Call, choose


def offloaded(
    inner: Union[optax.GradientTransformation, optax.MultiSteps],
    where: Where = min_ndim(1) & ~pattern("(.*/)?grad(/.*)?"),
    *,
    memory_kind: HostMemoryKind = "pinned_host",
    group_bytes: Union[int, Literal["auto"], None] = "auto",
    lookahead: int = 1,
    compute: Compute = "device",
    host_dtype: Any = None,
    accumulator: Accumulator = "device",
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation so that its state lives in host memory between steps.

    `init` makes the state directly in host memory. `update` brings the selected leaves
    to the device, runs `inner.update` there and sends the new state back; its updates
    and state are bitwise those of `inner` (unless `host_dtype` is set).

    **Arguments:**

    - `inner`: any `optax.GradientTransformation` (a whole `optax.chain(...)` too), or
        an `optax.MultiSteps`, whose inner state then crosses only on the micro-step
        that applies it (docs: "Gradient accumulation").
    - `where`: which leaves of the inner state live in host memory (a filter, as for
        `to_host`). The default keeps 0-d step counters on the device, and a line
        search's stored `grad`, which `optax.value_and_grad_from_state` reads.
        `eqx_offload.stream.within_budget` makes one for a device memory budget.
    - `memory_kind`: `"pinned_host"` (default), or `"unpinned_host"` (eager use only).
    - `group_bytes`: how the state comes to the device. `"auto"` (default): streamed
        in groups under `jit` for an accelerator where the update allows it, else the
        whole state at once; an int: always streamed, in groups of at most that many
        bytes; `None`: the whole state at once (docs: "Modes", "Streamed update").
    - `lookahead`: when streamed, how many groups come ahead of the one being updated
        (default 1: double buffering; 0: the smallest peak).
    - `compute`: `"device"` (default), or `"host"` to run `inner.update` on the host
        CPU: the state never comes to the device (docs: "Host-compute mode").
    - `host_dtype`: keep floating state in host memory in this narrower dtype (e.g.
        `jnp.bfloat16`), halving the bytes that cross; or `jnp.int8`: Adam's moments
        8-bit block-wise quantised, a quarter of the bytes. Not bitwise (docs: "Modes").
    - `accumulator`: for an `optax.MultiSteps`, where its accumulated gradients live
        between mini-steps: `"device"` (default), or `"host"`: each mini-step sends its
        gradients to host once and the host CPU adds them there (docs: "Gradient
        accumulation").

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose state is an `OffloadedState`;
    extra arguments to `update` go to `inner`.

    **Raises:**

    `OptionError` for a bad option, `MemoryKindError` for a memory kind the device
    lacks, `NotATransformationError` for an `inner` that is not a transformation.

    **Composition:** around any transformation, anywhere in an `optax.chain`, and
    inside `masked`, `multi_transform`, `inject_hyperparams`, `apply_if_finite` and
    `schedule_free`. `MultiSteps` belongs inside: `offloaded(optax.MultiSteps(...))`
    (docs: "Composition").

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
    inner = as_transformation(inner)
    options = normalise(where, memory_kind, group_bytes, lookahead, compute, host_dtype)
    check_accumulator(accumulator, multi, options)
    if multi is not None and crosses_once(options):
        # The inner state crosses once per optimizer step (see "Gradient accumulation").
        return offloaded_multi_steps(multi, options, accumulator)
    return _offloaded(inner, options, in_layer=False)


@dataclasses.dataclass(frozen=True)
class Made:
    """What an `offloaded(...)` transformation was made of: `inner` and the normalised
    `options`. Its `update` carries it (`made_of`), so that `update_in_backward` can
    make the transformation of its stacked layers with the same options (`for_layers`)."""

    inner: optax.GradientTransformationExtraArgs
    options: Options


def _offloaded(inner: optax.GradientTransformationExtraArgs, options: Options,
               in_layer: bool) -> optax.GradientTransformationExtraArgs:
    """`offloaded`'s transformation of `inner` under `options`. `in_layer`: a traced
    update leaves its new state on the device, narrowed (`for_layers`)."""
    strategy = choose(options)
    cache = Cache()  # layouts by the arguments' structure and shapes
    # Under `jit` the state is sent to host as it is made, so the whole state never is
    # in device memory; `filter_jit` gives each leaf the sharding of its parameter.
    jitted_init = filter_jit(functools.partial(_init_to_host, inner, options))

    def init_fn(params: optax.Params) -> OffloadedState:
        state = OffloadedState(_init(inner, options, jitted_init, params))
        # The state's layout found where it is made (for params of arrays alone: `init`
        # made it from what the check makes it from), for an update of gradients shaped
        # as `params`; any other update finds its own on its first call.
        if all(eqx.is_array(x) for x in jtu.tree_leaves(params)):
            layout_for(inner, options, cache, state, params, params, {})
        return state

    def update_fn(
        updates: optax.Updates,
        state: Any,  # (`check_is_offloaded` names a wrong state better than a type hint)
        params: Optional[optax.Params] = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, OffloadedState]:
        check_is_offloaded(state)
        layout, leaves, traced = layout_for(inner, options, cache, state, updates, params,
                                            extra_args)
        if traced:
            check_trace(layout.treedef, leaves, layout.mask)
        else:
            check_state_not_deleted(leaves, state)
        if not cache.warned:  # the cheap part: a memory kind per selected leaf, no walk
            i = first_on_device(leaves, layout.mask)
            if i is not None:
                cache.warned = warn_on_device(layout.treedef, leaves, i, options.memory_kind)
        updates, new_state = strategy(Call(inner, layout, traced), updates, state.inner_state,
                                      params, **extra_args)
        # One layer inside the backward pass: the new state stays on the device
        # (narrowed), and the backward scan writes it into the stacked host arrays, one copy.
        if traced and in_layer:
            return updates, OffloadedState(layout.narrow(new_state))
        return updates, OffloadedState(layout.store(new_state))

    # Errors leave these with the package's frames hidden (`compat.boundary`).
    update = boundary(update_fn)
    # (a function's attribute, PEP 232; read by `made_of`)
    update.made = Made(inner, options)  # type: ignore[attr-defined]  # a function's attribute
    return optax.GradientTransformationExtraArgs(boundary(init_fn), update)


def made_of(transformation: Any) -> Optional[Made]:
    """What made `transformation`, if `offloaded` did; else `None`."""
    made = getattr(getattr(transformation, "update", None), "made", None)
    return made if isinstance(made, Made) else None


def for_layers(made: Made, layers: int) -> optax.GradientTransformationExtraArgs:
    """The `offloaded` transformation `made` describes, for the state of `layers`
    stacked layers that `update_in_backward` updates one layer at a time inside the
    backward pass: 8-bit state packs each layer apart (`Options.stacked`), the default
    updates a layer's state whole (the layer scan streams the layers already), and a
    traced update leaves the new state on the device, narrowed, for the backward scan
    to write into the stacked host arrays (one copy)."""
    options = made.options
    options = dataclasses.replace(
        options, stacked=layers,
        group_bytes=None if options.group_bytes == "auto" else options.group_bytes)
    return _offloaded(made.inner, options, in_layer=True)


def _init_to_host(inner: optax.GradientTransformationExtraArgs, options: Options,
                  params: Any) -> Any:
    return store_tree(options, inner.init(params), "pinned_host")


def _init(inner: optax.GradientTransformationExtraArgs, options: Options, jitted_init: Any,
          params: Any) -> Any:
    if any(isinstance(x, Tracer) for x in jtu.tree_leaves(params)):
        state = _init_to_host(inner, options, params)
    else:
        check_not_deleted(params, "offloaded(...).init")
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


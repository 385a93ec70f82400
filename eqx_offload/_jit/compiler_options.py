"""The XLA options `filter_jit` compiles a step with by default: none, except for a GPU
when the step streams an offloaded state, prefetches layer weights, or brings the whole
state to the device in one update."""

from typing import Any


GPU_STREAMED_OPTIONS: dict[str, Any] = {
    "xla_gpu_experimental_parallel_async_compute_limit": 32,
    "xla_gpu_dot_merger_threshold_mb": 0,
}
"""What `filter_jit` compiles with by default for a GPU when the step streams an
offloaded state (see `default_compiler_options`)."""

GPU_WHOLE_STATE_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_analytical_sol_latency_estimator": False,
}
"""What `filter_jit` compiles with by default for a GPU when the step brings an
offloaded state to the device in one update (`group_bytes=None`, or the default where
the update cannot be streamed) and neither streams nor prefetches (see
`default_compiler_options`)."""

GPU_PREFETCHED_OPTIONS: dict[str, Any] = {
    "xla_gpu_experimental_parallel_async_compute_limit": 32,
}
"""What `filter_jit` compiles with by default for a GPU when the step prefetches layer
weights from host memory (`eqx_offload.scan_layers`) and streams no state."""

_GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})


def default_compiler_options(platform: str, streamed: bool,
                             prefetched: bool = False, whole: bool = False) -> dict[str, Any]:
    """The XLA options `filter_jit` compiles with unless its `compiler_options` (or
    `.compile(...)`'s) say otherwise: none, except for a GPU when the step runs
    `offloaded`'s streamed update (its default under `jit`, or `group_bytes=N`), or
    `scan_layers`' prefetch of host weights (then the copy limit alone: each layer's
    fetches, one per host leaf, wait for the layer before by data flow, so the limit
    lets them run side by side under that layer instead of one after the other), or
    the whole state in one update (`group_bytes=None`, or `"auto"` where the update
    cannot be streamed; then `GPU_WHOLE_STATE_OPTIONS`, below). They change the
    schedule and which matrix products XLA merges, not what any kernel computes
    element by element; the CPU backend gets none, so its programs (and results) are
    unchanged.

    - `xla_gpu_experimental_parallel_async_compute_limit=32`: XLA's GPU latency-hiding
        scheduler treats every host<->device copy as an asynchronous operation on one
        resource (`kGpuAsyncStreamComputes`), of which this many may be in flight at
        once (XLA's default: 2; `GpuAsyncTracker::GetNumAvailableResources` in
        `xla/service/gpu/gpu_latency_hiding_scheduler.cc`). The streamed update moves
        several state leaves each way per group (Adam: `mu` and `nu` of every
        parameter), so with 2 the copies of a group wait for each other and run back to
        back with no kernel under them. The barriers of the streamed update, not this
        limit, bound how much state is on the device; without them (the whole state in
        one update, `group_bytes=None`) the limit lets every copy start during the
        forward pass (in the plan of an MLP 2048 x 8: 580 MiB at the peak instead of
        500 MiB), so that mode does not get it.
    - `xla_gpu_dot_merger_threshold_mb=0`: XLA merges matrix products that share an
        operand (a transformer's q, k and v projections) into one; in a step with the
        copies, its scheduler then keeps the merged product alive from the forward pass
        to the backward pass (in the plan of the benchmark's transformer, 8 x 48 MiB at
        the peak), where separate products are freed one by one.

    In XLA's plan (H200, `eqx_offload.gpu_plan`), with the streamed update's barrier on
    the previous group's update, they take the default `offloaded(optax.adamw(...))`
    step of the benchmark's 118M-parameter transformer from 4687 MiB with 51% of its
    state's copies under compute to 4427 MiB with 100% (4683 MiB with the limit alone;
    see the "GPU plan" docs page for every workload).

    - `xla_gpu_enable_analytical_sol_latency_estimator=False`, for the whole state in
        one update only. The update has no barriers, so where each state leaf's copy
        to the device starts is the latency-hiding scheduler's choice. With its
        speed-of-light cost model (XLA's default on Hopper and Blackwell) a copy is
        worth hiding, and the scheduler starts every one of them before the first
        forward kernel: the whole state is on the device through the forward and
        backward passes, next to the activations, and the step holds more than the
        step without offload (whose state, donated, is updated in place). This option
        is XLA's escape hatch back to its older latency estimator
        (`GpuLatencyEstimator`, the one XLA uses on GPUs before Hopper), under which
        the scheduler keeps no kernel under a copy: each new state leaf goes back to
        host right after its update, and each copy to the device runs where the
        scheduler puts it, with nothing under it. In XLA's plan (H200) of the MLP
        2048 x 8, batch 256, each leaf then comes just before its update, after the
        backward pass: 244 MiB instead of 500 MiB (no offload: 508 MiB); of the
        benchmark's 118M-parameter transformer: 4607 MiB instead of 5492 MiB (5262).
        Of the MLP 1024 x 4, batch 8192, the copies to the device still all run
        before the forward pass, and the step plans at 320 MiB instead of 332 MiB
        (324) only by how the rest is scheduled: a margin, not a bound. The price: no
        copy of the state overlaps compute (before, the copies to host did; the copies
        to the device ran back to back before the first kernel either way). The
        option changes the estimates the scheduler orders by for the whole step: what
        it does to the collectives of a multi-device step has not been planned
        here."""
    if platform.lower() not in _GPU_PLATFORMS:
        return {}
    if streamed:
        return dict(GPU_STREAMED_OPTIONS)
    if prefetched:
        return dict(GPU_PREFETCHED_OPTIONS)
    if whole:
        return dict(GPU_WHOLE_STATE_OPTIONS)
    return {}

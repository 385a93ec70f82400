"""The XLA options `filter_jit` compiles a step with by default: none, except for a GPU
when the step streams an offloaded state, prefetches layer weights, or brings the whole
state to the device in one update, and for a TPU when the step streams an offloaded
state."""

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

TPU_STREAMED_OPTIONS: dict[str, Any] = {
    "xla_tpu_host_transfer_overlap_limit": 1,
}
"""What `filter_jit` compiles with by default for a TPU when the step streams an
offloaded state (see `default_compiler_options`)."""

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
        limit, bound how much state is on the device; the whole state in one update does
        not get it.
    - `xla_gpu_dot_merger_threshold_mb=0`: XLA merges matrix products that share an
        operand (a transformer's q, k and v projections) into one; in a step with the
        streamed update's copies, its scheduler then keeps the merged product alive from
        the forward pass to the backward pass, where separate products are freed one by
        one.
    - `xla_gpu_enable_analytical_sol_latency_estimator=False`, for the whole state in
        one update only. That update's copies to the device wait for the gradients (a
        barrier). XLA's speed-of-light cost model (its default on Hopper and Blackwell)
        finds a copy worth hiding under compute and starts it early; the older
        estimator (`GpuLatencyEstimator`, XLA's default before Hopper) keeps no kernel
        under a copy, so each leaf comes to the device near its update and leaves right
        after. It changes the estimates the scheduler orders by for the whole step.

    - `xla_tpu_host_transfer_overlap_limit=1`, for a TPU when the step streams: how many
        host<->device transfers XLA:TPU's scheduler keeps in flight. With libtpu's
        default it starts a group's copies in one direction together (`mu` and `nu`)
        and the other direction's after them, one direction at a time; with 1 it pairs
        each copy to the device with one to host, so both directions of the link run at
        once (the docs page "Streamed update" has the counts from XLA:TPU's schedule).

    What each option does to the plans of the benchmark's workloads: the "GPU plan"
    docs page."""
    if platform.lower() == "tpu":
        return dict(TPU_STREAMED_OPTIONS) if streamed else {}
    if platform.lower() not in _GPU_PLATFORMS:
        return {}
    if streamed:
        return dict(GPU_STREAMED_OPTIONS)
    if prefetched:
        return dict(GPU_PREFETCHED_OPTIONS)
    if whole:
        return dict(GPU_WHOLE_STATE_OPTIONS)
    return {}

"""Offloading only what must go: `within_budget` (a `where` for a device-memory budget)
and `prefetch_options` (XLA settings that let the state's copies overlap compute)."""

from typing import Any, Optional

import jax
import jax.tree_util as jtu
import optax

from ._errors import OptionError
from ._leaves import nbytes


def within_budget(inner: optax.GradientTransformation, params: Any, device_bytes: int) -> Any:
    """A `where` for `offloaded(inner, where)` that keeps as much optimizer state in
    device memory as `device_bytes` allows and offloads the rest, largest leaves first
    (one large leaf offloaded saves more than many small ones and costs one transfer).

    0-d leaves (step counters) always stay on the device and count against the budget.
    If even offloading every other leaf does not fit, everything else is offloaded.

    **Arguments:**

    - `inner`: the optax transformation to wrap (not yet `offloaded`).
    - `params`: the parameters, as arrays or `jax.ShapeDtypeStruct`s (nothing is
        computed: `inner.init` is traced abstractly).
    - `device_bytes`: how many bytes of optimizer state may stay in device memory.

    **Returns:**

    A pytree of bools shaped like `inner.init(params)`, for `offloaded`'s `where`.

    !!! Example

        ```python
        import jax.numpy as jnp
        import optax
        import eqx_offload

        params = {"big": jnp.ones((1024, 256)), "small": jnp.ones((16, 16))}
        # Adam keeps two moments per parameter: 2 x 1 MiB for "big", 2 x 1 KiB for "small".
        where = eqx_offload.within_budget(optax.adam(1e-3), params, device_bytes=4096)
        opt = eqx_offload.offloaded(optax.adam(1e-3), where)
        state = opt.init(params)
        assert state.inner_state[0].mu["big"].sharding.memory_kind == "pinned_host"
        assert state.inner_state[0].mu["small"].sharding.memory_kind == "device"
        ```
    """
    if isinstance(device_bytes, bool) or not isinstance(device_bytes, int) or device_bytes < 0:
        raise OptionError(
            f"within_budget(device_bytes={device_bytes!r}): device_bytes must be an int >= 0 "
            "(bytes of optimizer state that may stay in device memory)."
        )
    abstract = jax.eval_shape(inner.init, params)
    leaves, treedef = jtu.tree_flatten(abstract)
    sizes = [nbytes(x) if hasattr(x, "shape") else 0 for x in leaves]
    offload = [False] * len(leaves)
    on_device = sum(sizes)
    candidates = sorted((i for i, x in enumerate(leaves) if getattr(x, "ndim", 0) > 0),
                        key=lambda i: (-sizes[i], i))
    for i in candidates:
        if on_device <= device_bytes:
            break
        offload[i] = True
        on_device -= sizes[i]
    return jtu.tree_unflatten(treedef, offload)


def prefetch_options(device_bytes: Optional[int] = None) -> dict[str, Any]:
    """XLA compiler options that let the state's copies to the device start early and
    overlap the forward and backward passes, for `filter_jit(...,
    compiler_options=...)` (they apply to that executable alone).

    In `offloaded`'s default mode nothing in the program makes the copies of the state
    to the device wait for the gradients (they depend only on the state, an argument
    of the step; tested on the lowered program), and with `group_bytes` the first
    `lookahead + 1` groups depend on nothing either. When a copy actually starts is up
    to XLA's scheduler. On GPUs these options turn on the latency-hiding scheduler,
    which issues each copy (`copy-start`) as early as its memory limit allows and waits
    for it (`copy-done`) only where the data is used:

    - `xla_gpu_enable_latency_hiding_scheduler=True`: schedule asynchronous work
        (host<->device copies, collectives) to overlap compute.
    - `xla_gpu_memory_limit_slop_factor` (only with `device_bytes`): the percentage of
        the device's memory the scheduler may plan to use; copies started early hold
        their buffers longer, so this bounds how far ahead they go. Computed from
        `device_bytes` and the first local device's memory limit.

    Other backends ignore these options (the CPU has one memory, a TPU its own
    scheduler).

    **Arguments:**

    - `device_bytes`: the device memory the step may use, in bytes (default: XLA's
        own limit).

    **Returns:**

    A dict for `compiler_options`.
    """
    options: dict[str, Any] = {"xla_gpu_enable_latency_hiding_scheduler": True}
    if device_bytes is not None:
        if isinstance(device_bytes, bool) or not isinstance(device_bytes, int) or device_bytes <= 0:
            raise OptionError(
                f"prefetch_options(device_bytes={device_bytes!r}): device_bytes must be an "
                "int > 0 (bytes of device memory the step may use), or None."
            )
        stats = jax.local_devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit:
            options["xla_gpu_memory_limit_slop_factor"] = max(1, min(100, round(100 * device_bytes / limit)))
    return options

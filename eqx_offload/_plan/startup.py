"""`plan_startup`: XLA's plan of the start-up route (`eqx_offload.filter_make`) for a GPU
or a TPU, compiled without one: the device peak of making the model and its state, and
the host memory the run needs before its first step, the runtime's own share included.

Each program of the route is planned by `plan` as it will run; the start-up's device
peak is the largest of a program's peak plus the device arrays made before it (they stay
alive), and its host bytes are the arrays made in host memory plus what the TPU or GPU
runtime keeps in host memory for itself.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Optional, Union

from .._core.errors import OptionError
from .._core.leaves import nbytes
from .._models.make import Program, route
from .plan import plan
from .result import Plan
from .summary import MiB
from .targets import GpuTarget, TpuTarget


GB = 10**9
RUNTIME_HOST_BYTES: dict[str, int] = {"v5e": 14 * GB}
"""The host memory a chip's runtime holds for itself, by target name, where measured: a
TPU v5e host (40 GB) whose TPU runtime's process held about 14 GB while a step trained
(2026-12-06, JAX 0.10.2; `docs/capacity.md`, "This machine"). Other targets: 0 unless
given."""


@dataclasses.dataclass(frozen=True)
class StartupPlan:
    """XLA's plan of the start-up route of `eqx_offload.filter_make` (see `plan_startup`).
    A plan, not a measurement.

    **Fields:**

    - `programs`: `(what, runs, Plan)` for each program of the route, in order.
    - `device_peak_bytes`: the device memory the start-up holds at its peak: the largest
        program's peak plus the device arrays made before it.
    - `device_memory_bytes`: the memory JAX allocates on the target's device.
    - `host_array_bytes`: the bytes of the arrays the start-up leaves in host memory.
    - `host_peak_bytes`: the host bytes at the start-up's peak (arrays made, and the
        largest program's own host bytes), without the runtime's share.
    - `runtime_host_bytes`: the host memory the runtime holds for itself (given, or
        `RUNTIME_HOST_BYTES` for the target).
    - `host_memory_bytes`: the host memory given, or `None`.
    """

    programs: tuple[tuple[str, int, Plan], ...]
    device_peak_bytes: int
    device_memory_bytes: int
    host_array_bytes: int
    host_peak_bytes: int
    runtime_host_bytes: int
    host_memory_bytes: Optional[int]

    @property
    def fits(self) -> bool:
        """Whether the start-up fits the device and, where `host_memory` was given, the
        host with the runtime's share: the run can begin."""
        host = (self.host_memory_bytes is None
                or self.host_peak_bytes + self.runtime_host_bytes <= self.host_memory_bytes)
        return self.device_peak_bytes <= self.device_memory_bytes and host

    def summary(self) -> str:
        """A few lines for a person."""
        verdict = "fits" if self.fits else "does NOT fit"
        given = ("" if self.host_memory_bytes is None
                 else f" of the given {self.host_memory_bytes / GB:.1f} GB")
        lines = [f"XLA's plan of the start-up ({len(self.programs)} programs; a plan, not "
                 f"a measurement): {verdict}",
                 f"  device peak {self.device_peak_bytes / MiB:10.1f} MiB of "
                 f"{self.device_memory_bytes / MiB:.1f} MiB",
                 f"  host        {(self.host_peak_bytes + self.runtime_host_bytes) / GB:10.2f}"
                 f" GB{given}: arrays {self.host_array_bytes / GB:.2f} GB, the runtime's "
                 f"share {self.runtime_host_bytes / GB:.2f} GB"]
        lines += [f"    {what} (x{runs}): device peak {p.device_peak_bytes / MiB:.1f} MiB"
                  for what, runs, p in self.programs]
        return "\n".join(lines)


def _kind(x: Any) -> str:
    return str(getattr(x.sharding, "memory_kind", None) or "device")


def plan_startup(
    fun: Callable[..., Any],
    *args: Any,
    target: Union[str, GpuTarget, TpuTarget],
    host_memory: Optional[int] = None,
    runtime_host_memory: Optional[int] = None,
    group_bytes: int = 256 << 20,
    **kwargs: Any,
) -> StartupPlan:
    """XLA's plan of `eqx_offload.filter_make(fun, *args, **kwargs)` on a GPU or a TPU,
    compiled on this machine without one: whether the run can *begin*.

    A step that fits can still fail to start: a model made on the device in fp32 and
    converted there needs more device memory than the step. This plans each program of
    `filter_make`'s route with `eqx_offload.plan` (the same programs, as they will run)
    and adds what stays alive between them. Nothing is allocated.

    **Arguments:**

    - `fun`, `*args`, `**kwargs`: as for `filter_make` (arrays, or
        `jax.ShapeDtypeStruct`s with shardings).
    - `target`: as for `plan` (`"v5e"`, `"h100"`, ...).
    - `host_memory`: the host's memory (bytes); `StartupPlan.fits` then checks the
        arrays made in host memory with the runtime's share against it.
    - `runtime_host_memory`: the host memory the chip's runtime keeps for itself
        (bytes); default the measured value for the target
        (`eqx_offload.planner.RUNTIME_HOST_BYTES`: 14 GB for `"v5e"`), else 0.
    - `group_bytes`: as for `filter_make`.

    **Returns:**

    A `StartupPlan`; `print(plan.summary())` for a person.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import optax
        import eqx_offload

        def start(key):
            blocks = eqx_offload.stack_layers(lambda k: eqx.nn.Linear(256, 256, key=k),
                                              jax.random.split(key, 4))
            mw = eqx_offload.master_weights(optax.adamw(1e-3))
            return mw.init(eqx_offload.to_host(blocks))

        startup = eqx_offload.planner.plan_startup(start, jax.random.key(0), target="v5e",
                                                   host_memory=40 * 10**9)
        print(startup.summary())
        assert startup.device_peak_bytes < 4 * 256 * 256 * 14
        ```
    """
    import jax

    from .._core import compat

    if runtime_host_memory is None:
        runtime_host_memory = RUNTIME_HOST_BYTES.get(target, 0) if isinstance(target, str) else 0
    if isinstance(runtime_host_memory, bool) or not isinstance(
            runtime_host_memory, int) or runtime_host_memory < 0:
        raise OptionError(f"plan_startup(runtime_host_memory={runtime_host_memory!r}): pass "
                          "an int >= 0 (bytes the runtime holds in host memory), or None.")
    made = route(fun, args, kwargs, group_bytes=group_bytes)
    leaves = made.leaves
    layer = jax.ShapeDtypeStruct((), jax.numpy.int32,
                                 sharding=compat.single_device_sharding(jax.devices()[0]))
    planned: list[tuple[str, int, Plan]] = []
    device_made = host_made = 0
    device_peak = host_peak = 0
    memory = 0
    for program in made.programs:
        p = _plan_program(program, leaves, layer, made.dynamic, target)
        memory = p.usable_device_bytes
        mine = [leaves[i] for i in program.indices]
        own_device = sum(nbytes(x) for x in mine if _kind(x) == "device")
        own_host = sum(nbytes(x) for x in mine if _kind(x) != "device")
        # A layers program's buffers are its (donated) arguments, made by the one before.
        before_device = device_made - (own_device if program.kind == "layers" else 0)
        before_host = host_made - (own_host if program.kind == "layers" else 0)
        device_peak = max(device_peak, before_device + p.device_peak_bytes)
        host_peak = max(host_peak, before_host + p.host_total_bytes)
        if program.kind != "layers":
            device_made += own_device
            host_made += own_host
        planned.append((program.what, program.layers, p))
    host_arrays = sum(nbytes(x) for x in leaves
                      if hasattr(x, "sharding") and _kind(x) != "device")
    return StartupPlan(tuple(planned), device_peak, memory, host_arrays,
                       max(host_peak, host_arrays), runtime_host_memory, host_memory)


def _plan_program(program: Program, leaves: list[Any], layer: Any, dynamic: Any,
                  target: Union[str, GpuTarget, TpuTarget]) -> Plan:
    if program.kind == "layers":
        buffers = [leaves[i] for i in program.indices]
        return plan(program.fun, buffers, layer, dynamic, target=target)
    return plan(program.planned or program.fun, layer, dynamic, target=target)

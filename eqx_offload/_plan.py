"""`gpu_plan`: what a step would hold in an NVIDIA GPU's memory, and whether its copies
between host and device overlap compute, from XLA's GPU compiler run without a GPU.

The numbers are XLA's *plan* for the target (its buffer assignment and its schedule),
not a measurement: the device bytes are those XLA allocates for the executable, and a
copy "overlaps compute" when XLA's schedule puts at least one kernel between the copy's
start and its completion. How fast the copies actually are, and whether the runtime
overlaps them as scheduled, only a GPU can say.
"""

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal, Optional, Union


from . import _deviceless
from ._errors import OptionError, PlanError


MiB = 1 << 20

Direction = Literal["to_device", "to_host"]


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """An NVIDIA GPU that `gpu_plan` compiles for: the properties of XLA's GPU target
    description (`stream_executor.GpuTargetConfigProto`) that its cost model and
    scheduler read. `device_memory_size` is also the memory limit XLA's scheduler
    plans within.

    **Fields:** `name`, `device_memory_size` (bytes), `core_count` (SMs),
    `memory_bandwidth` (bytes/s), `clock_rate_ghz`, `l2_cache_size` (bytes),
    `compute_capability` (`(major, minor)`), `pcie_bandwidth` (bytes/s).
    """

    name: str
    device_memory_size: int
    core_count: int
    memory_bandwidth: int
    clock_rate_ghz: float
    l2_cache_size: int
    compute_capability: tuple[int, int]
    pcie_bandwidth: int

    def with_memory(self, device_memory_size: int) -> "GpuTarget":
        """The same GPU with `device_memory_size` bytes of device memory (a budget)."""
        return dataclasses.replace(self, device_memory_size=int(device_memory_size))

    def config_text(self) -> str:
        """The target in XLA's text format, for `get_topology_desc(target_config=...)`."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.device_memory_size}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{self.name}"
"""


GPU_TARGETS: Mapping[str, GpuTarget] = {
    "h100": GpuTarget("NVIDIA H100 80GB HBM3", 84942979072, 132, 3352320000000, 1.98,
                      52428800, (9, 0), 34359738368),
    "h200": GpuTarget("NVIDIA H200 141GB HBM3e", 151397597184, 132, 4800000000000, 1.98,
                      52428800, (9, 0), 34359738368),
}
"""The GPUs `gpu_plan` knows by name (`"h100"`: H100 SXM 80 GB; `"h200"`: H200 141 GB),
with their published properties as XLA's own target descriptions give them. For
another GPU, or a budget, make a `GpuTarget` (or `GPU_TARGETS["h200"].with_memory(n)`)."""


@dataclasses.dataclass(frozen=True)
class PlannedCopy:
    """One asynchronous copy between host and device memory in XLA's schedule.

    **Fields:** `direction` (`"to_device"` or `"to_host"`), `nbytes`, `overlapped`
    (at least one kernel is scheduled between the copy's start and its completion),
    `kernels` (how many), `name` (the `copy-start` instruction)."""

    direction: Direction
    nbytes: int
    overlapped: bool
    kernels: int
    name: str


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """XLA's plan for one step on a GPU target (see `gpu_plan`). XLA's numbers, not a
    measurement.

    **Fields:**

    - `target`: the GPU's name; `device_memory_size`: the device memory XLA planned
        within (bytes).
    - `device_peak_bytes`: device memory the executable holds at its peak: arguments
        + temporaries + outputs - outputs aliased to donated arguments.
    - `argument_bytes`, `output_bytes`, `alias_bytes`, `temp_bytes`: its parts (device).
    - `host_bytes`: host memory of its arguments, outputs and temporaries (less
        aliasing); `host_limit_bytes`: the pinned host pool it must fit in
        (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`).
    - `copies`: every host<->device copy, in schedule order.
    - `compiler_options`: the XLA options the step was compiled with.
    """

    target: str
    device_memory_size: int
    device_peak_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    host_bytes: int
    host_limit_bytes: int
    copies: tuple[PlannedCopy, ...]
    compiler_options: Mapping[str, Any]

    @property
    def fits(self) -> bool:
        """Whether the device peak fits in `device_memory_size`."""
        return self.device_peak_bytes <= self.device_memory_size

    @property
    def host_fits(self) -> bool:
        """Whether the host bytes fit in the pinned host pool."""
        return self.host_bytes <= self.host_limit_bytes

    def copies_to(self, direction: Direction) -> tuple[PlannedCopy, ...]:
        """The copies in one direction."""
        return tuple(c for c in self.copies if c.direction == direction)

    def overlapped_fraction(self, direction: Optional[Direction] = None, *,
                            by: Literal["count", "bytes"] = "count") -> float:
        """The share of copies (of `direction`, default both) that overlap compute, by
        count or by bytes; 1.0 if there are none."""
        copies = self.copies if direction is None else self.copies_to(direction)
        weight: Callable[[PlannedCopy], int] = (lambda c: 1) if by == "count" else (lambda c: c.nbytes)
        total = sum(weight(c) for c in copies)
        return 1.0 if total == 0 else sum(weight(c) for c in copies if c.overlapped) / total

    def summary(self) -> str:
        """A few lines for a person: peak, host bytes, copies, overlap."""
        def count(direction: Direction) -> str:
            copies = self.copies_to(direction)
            over = sum(c.overlapped for c in copies)
            return (f"{len(copies)} copies {direction.replace('_', ' ')} "
                    f"({sum(c.nbytes for c in copies) / MiB:.1f} MiB), {over} overlap compute")
        verdict = "fits" if self.fits else "does NOT fit"
        return "\n".join([
            f"XLA's plan for {self.target} (compiled without a GPU; a plan, not a measurement)",
            f"  device peak  {self.device_peak_bytes / MiB:10.1f} MiB of "
            f"{self.device_memory_size / MiB:.1f} MiB: {verdict}",
            f"    arguments {self.argument_bytes / MiB:.1f} + temporaries "
            f"{self.temp_bytes / MiB:.1f} + outputs {self.output_bytes / MiB:.1f} "
            f"- aliased {self.alias_bytes / MiB:.1f} MiB",
            f"  host         {self.host_bytes / MiB:10.1f} MiB of the pinned pool's "
            f"{self.host_limit_bytes / MiB:.0f} MiB" + ("" if self.host_fits else ": does NOT fit"),
            f"  {count('to_device')}",
            f"  {count('to_host')}",
            f"  compiler options: {dict(self.compiler_options) or 'XLA defaults'}",
        ])


def resolve_target(target: Union[str, GpuTarget], device_memory: Optional[int]) -> GpuTarget:
    if isinstance(target, GpuTarget):
        resolved = target
    elif isinstance(target, str) and target.lower() in GPU_TARGETS:
        resolved = GPU_TARGETS[target.lower()]
    else:
        raise OptionError(
            f"gpu_plan(target={target!r}): target must be one of "
            f"{', '.join(repr(t) for t in GPU_TARGETS)} or an eqx_offload.GpuTarget."
        )
    if device_memory is not None:
        if isinstance(device_memory, bool) or not isinstance(device_memory, int) or device_memory <= 0:
            raise OptionError(
                f"gpu_plan(device_memory={device_memory!r}): device_memory must be an int > 0 "
                "(bytes of device memory to plan within), or None for the target's own."
            )
        resolved = resolved.with_memory(device_memory)
    return resolved


def gpu_plan(
    fun: Callable[..., Any],
    *args: Any,
    target: Union[str, GpuTarget] = "h200",
    device_memory: Optional[int] = None,
    compiler_options: Optional[dict[str, Any]] = None,
    **kwargs: Any,
) -> GpuPlan:
    """XLA's plan for `fun(*args, **kwargs)` on an NVIDIA GPU, compiled on this machine
    without a GPU: the device memory the step holds at its peak, the host memory it
    uses, and which of its host<->device copies XLA schedules under compute.

    Ask "does my step fit on an H100 with offload, and are the copies hidden?" from a
    laptop. **A plan, not a measurement**: the bytes are XLA's buffer assignment for
    that GPU and the overlap is XLA's schedule; a copy's real duration (PCIe) and the
    step time need the GPU itself.

    **Arguments:**

    - `fun`: an `eqx_offload.filter_jit` function (its `donate` and `compiler_options`
        are used), or any function (compiled as `eqx_offload.filter_jit(fun)`).
    - `*args`, `**kwargs`: its arguments, as for a call (arrays on this machine's
        devices, e.g. the CPU; their memory kinds are what is planned). Nothing runs.
    - `target`: `"h200"` (default), `"h100"` (80 GB) or an `eqx_offload.GpuTarget`.
    - `device_memory`: plan within this many bytes of device memory instead of the
        target's (XLA's scheduler keeps within it where it can); `GpuPlan.fits` says
        whether the step does.
    - `compiler_options`: XLA options, added to `fun`'s own and to the defaults
        `filter_jit` compiles a GPU step with (`GpuPlan.compiler_options` lists them
        all).

    **Returns:**

    A `GpuPlan`; `print(plan.summary())` for a person.

    **Raises:**

    `PlanError` if the GPU compiler is not installed (the `plan` extra:
    `jax-cuda12-plugin` at the installed JAX version and `nvidia-cuda-nvcc-cu12`) or
    XLA cannot compile the step for the GPU; `OptionError` for a bad `target` or
    `device_memory`.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import optax
        import eqx_offload

        model = eqx.nn.MLP(256, 256, 256, 2, key=jax.random.key(0))
        opt = eqx_offload.offloaded(optax.adamw(1e-3))
        state = opt.init(eqx.filter(model, eqx.is_array))

        @eqx_offload.filter_jit(donate="all")
        def step(model, state, x):
            grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
            updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state

        plan = eqx_offload.gpu_plan(step, model, state, jnp.ones((64, 256)), target="h100")
        print(plan.summary())
        assert plan.copies_to("to_device") and plan.copies_to("to_host")
        ```
    """
    from ._jit import _flatten_call, _FilterJit, filter_jit

    resolved = resolve_target(target, device_memory)
    if compiler_options is not None and not isinstance(compiler_options, dict):
        raise OptionError(
            f"gpu_plan(compiler_options={compiler_options!r}): compiler_options must be a "
            "dict of XLA option names to values, or None."
        )
    jitted = fun if isinstance(fun, _FilterJit) else filter_jit(fun)
    _deviceless.check_available()
    call = _flatten_call(args, kwargs, jitted._donate)
    devices = {d for s in call.in_shardings for d in s.device_set}
    n_devices = max(1, len(devices))
    topology = _deviceless.topology(resolved.config_text(), n_devices)
    with _deviceless.compiling_for("cuda"):
        lowered = jitted._lower_call(call, platforms=("cuda",))
    # What `filter_jit` compiles with on a GPU: its defaults, its own options, these.
    options = {**lowered._default_options, **(jitted._compiler_options or {}),
               **(compiler_options or {})}
    try:
        executable = _deviceless.compile_for(lowered._lowered, list(topology.devices[:n_devices]),
                                             options)
    except Exception as error:
        raise PlanError(f"gpu_plan: XLA could not compile the step for {resolved.name}: "
                        f"{error}") from error
    stats = executable.get_compiled_memory_stats()
    device_peak = (stats.argument_size_in_bytes + stats.temp_size_in_bytes
                   + stats.output_size_in_bytes - stats.alias_size_in_bytes)
    host = (stats.host_argument_size_in_bytes + stats.host_temp_size_in_bytes
            + stats.host_output_size_in_bytes - stats.host_alias_size_in_bytes)
    text = "\n".join(m.to_string() for m in executable.hlo_modules())
    return GpuPlan(
        target=resolved.name,
        device_memory_size=resolved.device_memory_size,
        device_peak_bytes=int(device_peak),
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        host_bytes=int(host),
        host_limit_bytes=_deviceless.host_pool_limit_bytes(),
        copies=scheduled_copies(text),
        compiler_options=options,
    )


# ----------------------------------------------------------------------------------------
# Reading the scheduled program


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"\s(?P<op>[a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\](?:\{(?P<layout>[^}]*)\})?")
_OPERAND = re.compile(r"%([^\s,()]+)")

# Instructions that launch no kernel: bookkeeping, and the copies themselves.
_NOT_COMPUTE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start",
    "copy-done", "after-all", "opt-barrier", "partition-id", "replica-id",
    "add-dependency", "iota", "broadcast", "reshape",
})

_BITS = {"pred": 8, "s4": 4, "u4": 4, "f4e2m1fn": 4}


def _array_bytes(match: "re.Match[str]") -> int:
    dtype = match.group("dtype")
    bits = _BITS.get(dtype) or int(re.sub(r"[^0-9]", "", dtype.split("e")[0]) or 8)
    n = 1
    for d in filter(None, match.group("dims").split(",")):
        n *= int(d)
    return n * bits // 8


def _slice_copy(rest: str, op: "re.Match[str]") -> Optional[tuple[Direction, int]]:
    """A `fusion-start` that copies rows between host and device memory (XLA's
    asynchronous `dynamic-slice` from a host buffer, or `dynamic-update-slice` into
    one: the streamed update's pieces of a stacked leaf): its direction and bytes."""
    if "dynamic-slice" not in rest and "dynamic-update-slice" not in rest:
        return None
    arrays = list(_ARRAY.finditer(rest[: op.start()]))  # operands..., destination, context
    n_operands = len(_OPERAND.findall(rest[op.end(): rest.find(")", op.end())]))
    if len(arrays) <= n_operands:
        return None
    destination, operands = arrays[n_operands], arrays[:n_operands]

    def on_host(m: "re.Match[str]") -> bool:
        return "S(5)" in (m.group("layout") or "")

    if on_host(destination):
        moved = [m for m in operands if not on_host(m) and m.group("dims")]
        return ("to_host", sum(map(_array_bytes, moved))) if moved else None
    if any(on_host(m) for m in operands):
        return "to_device", _array_bytes(destination)
    return None


def scheduled_copies(hlo_text: str) -> tuple[PlannedCopy, ...]:
    """Every `copy-start`/`copy-done` pair of a scheduled HLO module, and every
    asynchronous slice copy between host and device (`fusion-start`/`fusion-done` of a
    `dynamic-slice` or `dynamic-update-slice`), with whether a kernel runs between them
    (per computation, in its schedule order)."""
    copies: list[PlannedCopy] = []
    open_copies: dict[str, tuple[Direction, int, int]] = {}  # name -> (dir, bytes, kernels so far)
    kernels = 0
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and not line.startswith(" "):
            open_copies.clear()  # a new computation
            kernels = 0
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        rest = match.group("rest")
        op = _OPCODE.search(rest)
        if op is None:
            continue
        opcode = op.group("op")
        if opcode == "copy-start":
            destination = _ARRAY.search(rest[: op.start()])
            if destination is None:
                continue
            layout = destination.group("layout") or ""
            direction: Direction = "to_host" if "S(5)" in layout else "to_device"
            open_copies[match.group("name")] = (direction, _array_bytes(destination), kernels)
        elif opcode == "fusion-start" and (moved := _slice_copy(rest, op)) is not None:
            slice_direction, slice_bytes = moved
            open_copies[match.group("name")] = (slice_direction, slice_bytes, kernels)
        elif opcode in ("copy-done", "fusion-done") and (
                started := open_copies.pop((_OPERAND.findall(rest[op.end():]) or [""])[0], None)
        ) is not None:
            direction, nbytes, before = started
            between = kernels - before
            name = _OPERAND.findall(rest[op.end():])[0]
            copies.append(PlannedCopy(direction, nbytes, between > 0, between, name))
        elif opcode not in _NOT_COMPUTE:
            kernels += 1
    return tuple(copies)

"""`gpu_plan`: what a step would hold in an NVIDIA GPU's memory, and whether its copies
between host and device overlap compute, from XLA's GPU compiler run without a GPU.

The numbers are XLA's *plan* for the target (its buffer assignment and its schedule),
not a measurement: the device bytes are those XLA allocates for the executable, and a
copy "overlaps compute" when XLA's schedule puts at least one kernel between the copy's
start and its completion. How fast the copies actually are, and whether the runtime
overlaps them as scheduled, only a GPU can say.
"""

import dataclasses
import importlib
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal, Optional, Union


from . import _deviceless
from ._errors import OptionError, PlanError
from ._memory import client_memory_fraction, run_settings


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
    `compute_capability` (`(major, minor)`), `pcie_bandwidth` (bytes/s, the value of
    XLA's own target description, which its cost model reads). The step's floors
    (`GpuPlan.compute_floor_seconds`, `GpuPlan.transfer_floor_seconds`) read the
    published peak rates: `bf16_flops`, `tf32_flops` (a float32 matrix product at
    JAX's default precision, which lets cuBLAS use TF32 on these GPUs), `fp32_flops`
    (at `precision=HIGHEST`), all dense, per second; and `host_link_bandwidth`, bytes
    per second each way between host and device (PCIe 5.0 x16: 64 GB/s; the one H200
    this project measured copied 43.5 GB/s at 256 MiB).
    """

    name: str
    device_memory_size: int
    core_count: int
    memory_bandwidth: int
    clock_rate_ghz: float
    l2_cache_size: int
    compute_capability: tuple[int, int]
    pcie_bandwidth: int
    bf16_flops: float = 989.4e12
    tf32_flops: float = 494.7e12
    fp32_flops: float = 66.9e12
    host_link_bandwidth: float = 64e9

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

    **Fields:** `direction` (`"to_device"` or `"to_host"`), `nbytes` (one execution),
    `overlapped` (at least one kernel is scheduled between the copy's start and its
    completion), `kernels` (how many), `name` (the `copy-start` instruction), `count`
    (how many times the step runs it: the trip counts of the loops around it, e.g. a
    layer's weight fetch in a scan over 32 layers runs 32 times), `conditional` (it is
    in a branch of a conditional, so it runs only when that branch is taken: the
    applying mini-step's copies of `offloaded(MultiSteps(...))`; `count` and
    `GpuPlan.bytes_moved` count it as taken)."""

    direction: Direction
    nbytes: int
    overlapped: bool
    kernels: int
    name: str
    count: int = 1
    conditional: bool = False


@dataclasses.dataclass(frozen=True)
class PlannedCollective:
    """One collective operation between devices in XLA's schedule of a multi-device
    step (per device).

    **Fields:** `kind` (`"all-gather"`, `"reduce-scatter"`, `"all-reduce"`,
    `"all-to-all"` or `"collective-permute"`), `nbytes` (the bytes of its result on
    one device, one execution), `count` (how many times the step runs it), `name`
    (the instruction)."""

    kind: str
    nbytes: int
    count: int
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
        aliasing), for one device; `host_limit_bytes`: the pinned host pool of the
        process (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`), which the host bytes of all
        `n_devices` must fit in; `host_memory_bytes`: the host memory given to
        `gpu_plan(host_memory=...)` for them, or `None`.
    - `n_devices`: the GPUs planned (one process drives them all); every byte count
        above is per device.
    - `copies`: every host<->device copy, in schedule order; `collectives`: every
        collective between devices (none on one device).
    - `matmul_flops`: the step's matrix-product flops on one device, by the rate they
        run at (`"bf16"`, `"tf32"`, `"fp32"`; see `GpuTarget`), counted in the traced
        program with every loop iteration and every rematerialised recomputation (XLA's
        own cost analysis counts a loop's body once and is not available for a
        compile-only GPU); an even split over the devices is assumed.
    - `hbm_bytes`: a lower bound on the device memory traffic of the step on one
        device: its device arguments and results read or written once, and every
        copy's bytes.
    - `gpu`: the `GpuTarget` planned for (its rates give the floors).
    - `compiler_options`: the XLA options the step was compiled with.
    - `memory_fraction`: the share of `device_memory_size` a JAX process can allocate
        (`XLA_CLIENT_MEM_FRACTION`, default 0.75, read when the plan is made; 1.0 for a
        `device_memory` given to `gpu_plan`, which is taken as what the step may use);
        `memory_fraction_source`: what set it.
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
    n_devices: int = 1
    host_memory_bytes: Optional[int] = None
    collectives: tuple[PlannedCollective, ...] = ()
    matmul_flops: Mapping[str, float] = dataclasses.field(default_factory=dict)
    hbm_bytes: int = 0
    gpu: Optional[GpuTarget] = None
    memory_fraction: float = 1.0
    memory_fraction_source: str = "the given device_memory"

    @property
    def usable_device_bytes(self) -> int:
        """The device memory a JAX process can allocate: `memory_fraction` of
        `device_memory_size`."""
        return int(self.device_memory_size * self.memory_fraction)

    @property
    def fits(self) -> bool:
        """Whether the device peak fits in the memory JAX allocates
        (`usable_device_bytes`), as the run is set up now."""
        return self.device_peak_bytes <= self.usable_device_bytes

    def run_settings(self) -> list[str]:
        """The environment variables (`NAME=value`) a run of this step needs beyond the
        current ones: a memory fraction where the peak is above the share JAX allocates
        but within the device, a pinned host pool where the host bytes exceed it."""
        return run_settings(self.device_peak_bytes, self.device_memory_size,
                            self.memory_fraction, self.host_total_bytes, self.host_limit_bytes)

    @property
    def host_total_bytes(self) -> int:
        """The host bytes of every planned device together (one process)."""
        return self.host_bytes * self.n_devices

    @property
    def host_fits(self) -> bool:
        """Whether the host bytes of all devices fit in the pinned host pool, and in
        `host_memory_bytes` where one was given."""
        fits_pool = self.host_total_bytes <= self.host_limit_bytes
        return fits_pool and (self.host_memory_bytes is None
                              or self.host_total_bytes <= self.host_memory_bytes)

    def copies_to(self, direction: Direction) -> tuple[PlannedCopy, ...]:
        """The copies in one direction."""
        return tuple(c for c in self.copies if c.direction == direction)

    def bytes_moved(self, direction: Direction) -> int:
        """Bytes the step moves in one direction on one device (every execution of
        every copy)."""
        return sum(c.nbytes * c.count for c in self.copies_to(direction))

    @property
    def compute_floor_seconds(self) -> float:
        """The step's compute floor on one device: its matrix-product flops at the
        GPU's peak rates, or its `hbm_bytes` at the memory bandwidth, whichever is
        longer. A lower bound, not a prediction: no kernel reaches the peak."""
        rates = self._rates()
        flops = sum(n / rates[kind] for kind, n in self.matmul_flops.items())
        return max(flops, self.hbm_bytes / rates["hbm"])

    @property
    def transfer_floor_seconds(self) -> float:
        """The time the host<->device link needs for the step's copies at
        `GpuTarget.host_link_bandwidth`, both directions at once (full duplex): the
        larger direction. A lower bound, not a prediction."""
        larger = max(self.bytes_moved("to_device"), self.bytes_moved("to_host"))
        return larger / self._rates()["link"]

    @property
    def floor_ratio(self) -> float:
        """`max(compute floor, transfer floor) / compute floor`: a lower bound on the
        step time with offload relative to the compute floor (1.0: the copies can
        hide under compute). What offload adds at best, not what it adds."""
        compute = self.compute_floor_seconds
        transfer = self.transfer_floor_seconds
        return 1.0 if compute == 0 else max(compute, transfer) / compute

    def _rates(self) -> dict[str, float]:
        gpu = self.gpu or GPU_TARGETS["h100"]
        return {"bf16": gpu.bf16_flops, "tf32": gpu.tf32_flops, "fp32": gpu.fp32_flops,
                "hbm": float(gpu.memory_bandwidth), "link": gpu.host_link_bandwidth}

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
            runs = sum(c.count for c in copies)
            looped = "" if runs == len(copies) else f", {runs} runs with the loops'"
            return (f"{len(copies)} copies {direction.replace('_', ' ')}{looped} "
                    f"({self.bytes_moved(direction) / MiB:.1f} MiB moved), "
                    f"{over} overlap compute")
        verdict = "fits" if self.fits else "does NOT fit"
        devices = "" if self.n_devices == 1 else f" x {self.n_devices} devices (per device)"
        host_of = f"the pinned pool's {self.host_limit_bytes / MiB:.0f} MiB"
        if self.host_memory_bytes is not None:
            host_of += f" and the given {self.host_memory_bytes / MiB:.0f} MiB"
        lines = [
            f"XLA's plan for {self.target}{devices} (compiled without a GPU; a plan, "
            "not a measurement)",
            f"  device peak  {self.device_peak_bytes / MiB:10.1f} MiB of "
            f"{self.usable_device_bytes / MiB:.1f} MiB JAX allocates "
            f"({self.memory_fraction:.0%} of {self.device_memory_size / MiB:.1f} MiB: "
            f"{self.memory_fraction_source}): {verdict}",
            f"    arguments {self.argument_bytes / MiB:.1f} + temporaries "
            f"{self.temp_bytes / MiB:.1f} + outputs {self.output_bytes / MiB:.1f} "
            f"- aliased {self.alias_bytes / MiB:.1f} MiB",
            f"  host         {self.host_total_bytes / MiB:10.1f} MiB of {host_of}"
            + ("" if self.host_fits else ": does NOT fit"),
            f"  {count('to_device')}",
            f"  {count('to_host')}",
        ]
        if self.collectives:
            kinds: dict[str, list[int]] = {}
            for c in self.collectives:
                n, b = kinds.setdefault(c.kind, [0, 0])
                kinds[c.kind] = [n + c.count, b + c.nbytes * c.count]
            lines.append("  collectives: " + ", ".join(
                f"{n} {kind} ({b / MiB:.1f} MiB)" for kind, (n, b) in kinds.items()))
        if self.matmul_flops:
            lines.append(
                f"  floors (lower bounds, not predictions): compute "
                f"{self.compute_floor_seconds * 1e3:.2f} ms, transfer "
                f"{self.transfer_floor_seconds * 1e3:.2f} ms, ratio {self.floor_ratio:.2f}")
        lines.append(f"  compiler options: {dict(self.compiler_options) or 'XLA defaults'}")
        settings = self.run_settings()
        if settings:
            lines.append("  run with: " + " ".join(settings))
        return "\n".join(lines)


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
    host_memory: Optional[int] = None,
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
    - `*args`, `**kwargs`: its arguments, as for a call: arrays on this machine's
        devices (e.g. the CPU; their memory kinds are what is planned), or
        `jax.ShapeDtypeStruct`s with shardings on those devices that carry the
        memory kinds (`eqx_offload.filter_eval_shape` of the model and of
        `optimizer.init`, or `eqx_offload.abstract_init`): a step of any size plans
        without allocating one of its arrays. Nothing runs. With a sharding over
        several devices (a `NamedSharding` of a `jax.make_mesh`), the plan is for as
        many GPUs.
    - `target`: `"h200"` (default), `"h100"` (80 GB) or an `eqx_offload.GpuTarget`.
    - `device_memory`: plan within this many bytes of device memory instead of the
        target's (XLA's scheduler keeps within it where it can); `GpuPlan.fits` says
        whether the step does.
    - `compiler_options`: XLA options, added to `fun`'s own and to the defaults
        `filter_jit` compiles a GPU step with (`GpuPlan.compiler_options` lists them
        all).
    - `host_memory`: the host memory (bytes) the process driving the planned GPUs has
        (e.g. 2 TB for an 8-GPU node); `GpuPlan.host_fits` then checks it as well as
        the pinned host pool.

    **Returns:**

    A `GpuPlan`; `print(plan.summary())` for a person.

    **Raises:**

    `PlanError` if the GPU compiler is not installed (the `plan` extra:
    `jax-cuda12-plugin` at the installed JAX version and `nvidia-cuda-nvcc-cu12`), an
    abstract argument has no sharding the plan can use, or XLA cannot compile the step
    for the GPU; `OptionError` for a bad `target`, `device_memory` or `host_memory`.

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
    fraction, source = (1.0, "the given device_memory") if device_memory is not None else (
        client_memory_fraction())
    if compiler_options is not None and not isinstance(compiler_options, dict):
        raise OptionError(
            f"gpu_plan(compiler_options={compiler_options!r}): compiler_options must be a "
            "dict of XLA option names to values, or None."
        )
    if host_memory is not None and (isinstance(host_memory, bool) or not isinstance(
            host_memory, int) or host_memory <= 0):
        raise OptionError(
            f"gpu_plan(host_memory={host_memory!r}): host_memory must be an int > 0 (bytes "
            "of host memory for the planned GPUs together), or None."
        )
    jitted = fun if isinstance(fun, _FilterJit) else filter_jit(fun)
    _deviceless.check_available()
    check_abstract_arguments(args, kwargs)
    call = _flatten_call(args, kwargs, jitted._donate, abstract=True)
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
    copies = scheduled_copies(text)
    hbm = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           + sum(c.nbytes * c.count for c in copies))
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
        copies=copies,
        compiler_options=options,
        n_devices=n_devices,
        host_memory_bytes=host_memory,
        collectives=scheduled_collectives(text),
        matmul_flops={kind: n / n_devices for kind, n in matmul_flops(lowered._jaxpr).items()},
        hbm_bytes=int(hbm),
        gpu=resolved,
        memory_fraction=fraction,
        memory_fraction_source=source,
    )


def check_abstract_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise a `PlanError` naming the argument's path for a `jax.ShapeDtypeStruct`
    without a sharding, or with one on devices that are not this process's (e.g. a
    compile-only GPU topology's, whose devices have no host memory)."""
    import jax
    import jax.tree_util as jtu

    local = set(jax.devices())
    keyed = jtu.tree_flatten_with_path((args, kwargs))[0]
    for path, leaf in keyed:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            continue
        where = ("args" if path[0] == jtu.SequenceKey(0) else "kwargs") + jtu.keystr(path[1:])
        shape = f"{leaf.dtype}{list(leaf.shape)}"
        if leaf.sharding is None:
            raise PlanError(
                f"gpu_plan: the abstract argument {where} ({shape}) has no sharding, so the "
                "plan cannot tell which device or memory it is in. Give it one, e.g. "
                "`eqx_offload.restore_target(tree)` (every leaf on the default device, "
                "`where=` to host memory) or `jax.ShapeDtypeStruct(shape, dtype, sharding="
                "jax.sharding.NamedSharding(mesh, spec, memory_kind=...))`; "
                "`eqx_offload.filter_eval_shape` keeps the shardings a function gives."
            )
        if not isinstance(leaf.sharding, jax.sharding.Sharding) or not set(
                leaf.sharding.device_set) <= local:
            raise PlanError(
                f"gpu_plan: the abstract argument {where} ({shape}) has the sharding "
                f"{leaf.sharding!r}, whose devices are not this process's "
                f"({jax.devices()[0].platform} devices). The plan lowers with shardings on "
                "this machine's devices (they carry memory kinds; the GPU is described "
                "by `target=`): build the sharding over `jax.devices()`, e.g. "
                "`jax.make_mesh(...)` (for several GPUs on a CPU machine, set "
                "`jax_num_cpu_devices` before JAX starts)."
            )


# ----------------------------------------------------------------------------------------
# Counting the step's flops


def _dot_flops(eqn: Any) -> tuple[str, float]:
    import numpy as np

    lhs, rhs = (v.aval for v in eqn.invars[:2])
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    rhs_free = [d for i, d in enumerate(rhs.shape) if i not in rhs_contract and i not in rhs_batch]
    flops = 2.0 * float(np.prod(lhs.shape, dtype=float)) * float(np.prod(rhs_free, dtype=float))
    return _rate_kind(eqn, lhs.dtype), flops


def _conv_flops(eqn: Any) -> tuple[str, float]:
    import numpy as np

    lhs, rhs = (v.aval for v in eqn.invars[:2])
    out = eqn.outvars[0].aval
    # Each output element: a sum over the kernel's spatial window and its input features.
    out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
    per_output = float(np.prod(rhs.shape, dtype=float)) / max(1, out_features)
    return _rate_kind(eqn, lhs.dtype), 2.0 * float(np.prod(out.shape, dtype=float)) * per_output


def _rate_kind(eqn: Any, dtype: Any) -> str:
    import jax
    import numpy as np

    if np.dtype(dtype).itemsize <= 2:
        return "bf16"
    precision = eqn.params.get("precision")
    highest = jax.lax.Precision.HIGHEST
    if precision is not None and any(p == highest for p in (
            precision if isinstance(precision, tuple) else (precision,))):
        return "fp32"
    return "tf32"


def _sub_jaxprs(params: Mapping[str, Any]) -> list[Any]:
    core: Any = importlib.import_module("jax.extend.core")  # not in every checker's stubs
    found: list[Any] = []  # jaxprs
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, core.ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, core.Jaxpr):
                found.append(v)
    return found


def _total(flops: dict[str, float]) -> float:
    return float(sum(flops.values()))


def matmul_flops(jaxpr: Any) -> dict[str, float]:
    """The matrix-product (`dot_general`, convolution) flops of a jaxpr, by the rate
    they run at (`"bf16"`, `"tf32"`, `"fp32"`): every iteration of a `scan`, the
    costlier branch of a `cond`, one iteration of a `while` (its trip count is not
    known), and everything inside calls, custom derivatives and remat (whose
    recomputation is part of the program). Elementwise work is not counted."""
    totals: dict[str, float] = {}

    def add(kind: str, flops: float) -> None:
        totals[kind] = totals.get(kind, 0.0) + flops

    def walk(jaxpr: Any, times: float) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "dot_general":
                kind, flops = _dot_flops(eqn)
                add(kind, flops * times)
            elif name == "conv_general_dilated":
                kind, flops = _conv_flops(eqn)
                add(kind, flops * times)
            elif name == "cond":
                branches = [matmul_flops(b.jaxpr) for b in eqn.params["branches"]]
                costliest: dict[str, float] = max(branches, key=_total, default={})
                for kind, flops in costliest.items():
                    add(kind, flops * times)
            else:
                repeat = float(eqn.params.get("length", 1)) if name == "scan" else 1.0
                for sub in _sub_jaxprs(eqn.params):
                    walk(sub, times * repeat)

    walk(getattr(jaxpr, "jaxpr", jaxpr), 1.0)
    return totals


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


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[^\s(]+)")
_WHILE_BODY = re.compile(r"\bbody=%(?P<body>[^\s,]+)")
_CALLED = re.compile(r"\b(?:condition|calls|to_apply|body|branch_computations|"
                     r"true_computation|false_computation|async_execution_thread)=\{?(?P<names>%[^\s,}]+(?:,\s*%[^\s,}]+)*)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>[0-9]+)"')


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """The computations of an HLO module's text: name -> instruction lines."""
    found: dict[str, list[str]] = {}
    current: Optional[list[str]] = None
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and not line.startswith(" "):
            match = _COMPUTATION.match(line)
            current = found.setdefault(match.group("name") if match else line, [])
            continue
        if current is not None:
            current.append(line)
    return found


_BRANCHES = ("branch_computations", "true_computation", "false_computation")


def _calls(hlo_text: str) -> dict[str, list[tuple[str, bool]]]:
    """Per computation of an HLO module's text: the computations it calls, each with
    whether it is a branch of a conditional."""
    found: dict[str, list[tuple[str, bool]]] = {}
    for name, lines in _computations(hlo_text).items():
        for line in lines:
            for match in _CALLED.finditer(line):
                branch = match.group(0).startswith(_BRANCHES)
                found.setdefault(name, []).extend(
                    (callee.strip().lstrip("%"), branch)
                    for callee in match.group("names").split(","))
    return found


def conditional_computations(hlo_text: str) -> frozenset[str]:
    """The computations of an HLO module that run only when a conditional takes a
    branch: its branches and everything they call."""
    calls = _calls(hlo_text)
    found: set[str] = set()
    pending = [callee for callees in calls.values() for callee, branch in callees if branch]
    while pending:
        name = pending.pop()
        if name not in found:
            found.add(name)
            pending.extend(callee for callee, _ in calls.get(name, []))
    return frozenset(found)


def run_counts(hlo_text: str) -> dict[str, int]:
    """How many times a step runs each computation of its scheduled HLO: 1 for the
    entry, the trip count of the loop (`known_trip_count`) times its caller's for a
    loop body, the caller's for anything else it calls."""
    computations = _computations(hlo_text)
    called: dict[str, list[tuple[str, int]]] = {}
    for name, lines in computations.items():
        for line in lines:
            body = _WHILE_BODY.search(line)
            trips = _TRIP_COUNT.search(line)
            for match in _CALLED.finditer(line):
                for callee in match.group("names").split(","):
                    callee = callee.strip().lstrip("%")
                    times = int(trips.group("n")) if (
                        body and trips and callee == body.group("body")) else 1
                    called.setdefault(name, []).append((callee, times))
    callers = {c for calls in called.values() for c, _ in calls}
    counts: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        counts[name] = counts.get(name, 0) + times
        for callee, trips in called.get(name, []):
            visit(callee, times * trips)

    for root in [n for n in computations if n not in callers]:
        visit(root, 1)
    return counts


def scheduled_collectives(hlo_text: str) -> tuple[PlannedCollective, ...]:
    """Every collective between devices in a scheduled HLO module (its synchronous
    form or the start of its asynchronous form), with its result's bytes and how many
    times the step runs it."""
    counts = run_counts(hlo_text)
    found: list[PlannedCollective] = []
    for computation, lines in _computations(hlo_text).items():
        for line in lines:
            match = _INSTRUCTION.match(line)
            op = _OPCODE.search(match.group("rest")) if match else None
            if match is None or op is None:
                continue
            kind = op.group("op").removesuffix("-start")
            if kind not in _COLLECTIVES or op.group("op").endswith("-done"):
                continue
            rest = match.group("rest")
            results = list(_ARRAY.finditer(rest[: op.start()]))
            # An asynchronous start's result is (operands, results[, context]).
            result = results[len(results) // 2] if op.group("op").endswith("-start") and len(
                results) > 1 else (results[0] if results else None)
            found.append(PlannedCollective(
                kind, _array_bytes(result) if result else 0, counts.get(computation, 1),
                match.group("name")))
    return tuple(found)


_COLLECTIVES = frozenset({"all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                          "collective-permute"})


def scheduled_copies(hlo_text: str) -> tuple[PlannedCopy, ...]:
    """Every `copy-start`/`copy-done` pair of a scheduled HLO module, and every
    asynchronous slice copy between host and device (`fusion-start`/`fusion-done` of a
    `dynamic-slice` or `dynamic-update-slice`), with whether a kernel runs between them
    (per computation, in its schedule order) and how many times the step runs it."""
    counts = run_counts(hlo_text)
    conditional = conditional_computations(hlo_text)
    in_branch = False
    copies: list[PlannedCopy] = []
    open_copies: dict[str, tuple[Direction, int, int]] = {}  # name -> (dir, bytes, kernels so far)
    kernels = 0
    runs = 1
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and not line.startswith(" "):
            open_copies.clear()  # a new computation
            kernels = 0
            computation = _COMPUTATION.match(line)
            runs = counts.get(computation.group("name"), 1) if computation else 1
            in_branch = computation is not None and computation.group("name") in conditional
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
            copies.append(PlannedCopy(direction, nbytes, between > 0, between, name, runs,
                                      in_branch))
        elif opcode not in _NOT_COMPUTE:
            kernels += 1
    return tuple(copies)

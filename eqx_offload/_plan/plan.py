"""`plan`: what a step would hold in a GPU's or a TPU's memory, and whether its copies
between host and device overlap compute, from XLA's own compiler for that chip run
without one (XLA's GPU compiler, or libtpu).

The numbers are XLA's *plan* for the target (its buffer assignment and its schedule),
not a measurement: the device bytes are those XLA allocates for the executable, and a
copy "overlaps compute" when XLA's schedule puts at least one kernel between the copy's
start and its completion. How fast the copies actually are, and whether the runtime
overlaps them as scheduled, only the chip can say (`docs/gpu-plan.md`).
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, Optional, Union

from .._core.errors import OptionError, PlanError
from . import deviceless as _deviceless, tpu as _tpu
from .flops import matmul_flops
from .hlo import (
    Direction, PlannedCollective, PlannedCopy, scheduled_collectives, scheduled_copies,
)
from .._core.memory import client_memory_fraction, run_settings
from .targets import GPU_TARGETS, GpuTarget, resolve_target, Target, TpuTarget


MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Plan:
    """XLA's plan for one step on a GPU or TPU target (see `plan`). XLA's numbers, not a
    measurement.

    **Fields:**

    - `target`: the chip's name; `device_memory_size`: the device memory XLA planned
        within (bytes; for a TPU, the HBM XLA:TPU lets a program use).
    - `device_peak_bytes`: device memory the executable holds at its peak: arguments
        + temporaries + outputs - outputs aliased to donated arguments.
    - `argument_bytes`, `output_bytes`, `alias_bytes`, `temp_bytes`: its parts (device).
    - `host_bytes`: host memory of its arguments, outputs and temporaries (less
        aliasing), for one device; `host_limit_bytes`: on a GPU, the pinned host pool
        of the process (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`), which the host bytes of
        all `n_devices` must fit in (`None` on a TPU, which has no such pool);
        `host_memory_bytes`: the host memory given to `plan(host_memory=...)` for
        them, or `None`.
    - `n_devices`: the chips planned (one process drives them all); every byte count
        above is per device.
    - `copies`: every host<->device copy, in schedule order; `collectives`: every
        collective between devices (none on one device).
    - `matmul_flops`: the step's matrix-product flops on one device, by the rate they
        run at (`"bf16"`, `"tf32"`, `"fp32"`; see `GpuTarget`, `TpuTarget`), counted in
        the traced program with every loop iteration and every rematerialised
        recomputation (XLA's own cost analysis counts a loop's body once and is not
        available for a compile-only GPU); an even split over the devices is assumed.
    - `hbm_bytes`: a lower bound on the device memory traffic of the step on one
        device: its device arguments and results read or written once, and every
        copy's bytes.
    - `chip`: the `GpuTarget` or `TpuTarget` planned for (its rates give the floors).
    - `compiler_options`: the XLA options the step was compiled with.
    - `memory_fraction`: the share of `device_memory_size` a JAX process can allocate
        (on a GPU `XLA_CLIENT_MEM_FRACTION`, default 0.75, read when the plan is made;
        1.0 on a TPU, and for a `device_memory` given to `plan`, which is taken as what
        the step may use); `memory_fraction_source`: what set it.
    """

    target: str
    device_memory_size: int
    device_peak_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    host_bytes: int
    host_limit_bytes: Optional[int]
    copies: tuple[PlannedCopy, ...]
    compiler_options: Mapping[str, Any]
    n_devices: int = 1
    host_memory_bytes: Optional[int] = None
    collectives: tuple[PlannedCollective, ...] = ()
    matmul_flops: Mapping[str, float] = dataclasses.field(default_factory=dict)
    hbm_bytes: int = 0
    chip: Optional[Target] = None
    memory_fraction: float = 1.0
    memory_fraction_source: str = "the given device_memory"

    @property
    def gpu(self) -> Optional[GpuTarget]:
        """The `GpuTarget` planned for, or `None` for a TPU's plan."""
        return self.chip if isinstance(self.chip, GpuTarget) else None

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
        limit = self.host_total_bytes if self.host_limit_bytes is None else self.host_limit_bytes
        return run_settings(self.device_peak_bytes, self.device_memory_size,
                            self.memory_fraction, self.host_total_bytes, limit)

    @property
    def host_total_bytes(self) -> int:
        """The host bytes of every planned device together (one process)."""
        return self.host_bytes * self.n_devices

    @property
    def host_fits(self) -> bool:
        """Whether the host bytes of all devices fit in the pinned host pool (a GPU's),
        and in `host_memory_bytes` where one was given."""
        fits_pool = self.host_limit_bytes is None or self.host_total_bytes <= self.host_limit_bytes
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
        chip's peak rates, or its `hbm_bytes` at the memory bandwidth, whichever is
        longer. A lower bound, not a prediction: no kernel reaches the peak."""
        rates = self._rates()
        flops = sum(n / rates[kind] for kind, n in self.matmul_flops.items())
        return max(flops, self.hbm_bytes / rates["hbm"])

    @property
    def transfer_floor_seconds(self) -> float:
        """The time the host<->device link needs for the step's copies at
        the target's `host_link_bandwidth`, both directions at once (full duplex): the
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
        chip = self.chip or GPU_TARGETS["h100"]
        return {"bf16": chip.bf16_flops, "tf32": chip.tf32_flops, "fp32": chip.fp32_flops,
                "hbm": float(chip.memory_bandwidth), "link": chip.host_link_bandwidth}

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
        pools = [] if self.host_limit_bytes is None else [
            f"the pinned pool's {self.host_limit_bytes / MiB:.0f} MiB"]
        if self.host_memory_bytes is not None:
            pools.append(f"the given {self.host_memory_bytes / MiB:.0f} MiB")
        host_of = " of " + " and ".join(pools) if pools else ""
        compiler = "a TPU" if isinstance(self.chip, TpuTarget) else "a GPU"
        lines = [
            f"XLA's plan for {self.target}{devices} (compiled without {compiler}; a plan, "
            "not a measurement)",
            f"  device peak  {self.device_peak_bytes / MiB:10.1f} MiB of "
            f"{self.usable_device_bytes / MiB:.1f} MiB JAX allocates "
            f"({self.memory_fraction:.0%} of {self.device_memory_size / MiB:.1f} MiB: "
            f"{self.memory_fraction_source}): {verdict}",
            f"    arguments {self.argument_bytes / MiB:.1f} + temporaries "
            f"{self.temp_bytes / MiB:.1f} + outputs {self.output_bytes / MiB:.1f} "
            f"- aliased {self.alias_bytes / MiB:.1f} MiB",
            f"  host         {self.host_total_bytes / MiB:10.1f} MiB{host_of}"
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



def plan(
    fun: Callable[..., Any],
    *args: Any,
    target: Union[str, GpuTarget, TpuTarget],
    device_memory: Optional[int] = None,
    compiler_options: Optional[dict[str, Any]] = None,
    host_memory: Optional[int] = None,
    **kwargs: Any,
) -> Plan:
    """XLA's plan for `fun(*args, **kwargs)` on an NVIDIA GPU or a Google TPU, compiled
    on this machine without one: the device memory the step holds at its peak, the host
    memory it uses, and which of its host<->device copies XLA schedules under compute.

    Ask "does my step fit on an H100 (or a TPU v5e) with offload, and are the copies
    hidden?" from a laptop. **A plan, not a measurement**: the bytes are XLA's buffer
    assignment for that chip and the overlap is XLA's schedule; a copy's real duration
    and the step time need the chip itself. What the plans show, and how they compare
    with measured steps: `docs/gpu-plan.md`.

    **Arguments:**

    - `fun`: an `eqx_offload.filter_jit` function (its `donate` and `compiler_options`
        are used), or any function (compiled as `eqx_offload.filter_jit(fun)`).
    - `*args`, `**kwargs`: its arguments, as for a call: arrays on this machine's
        devices (e.g. the CPU; their memory kinds are what is planned), or
        `jax.ShapeDtypeStruct`s with shardings on those devices that carry the
        memory kinds (`eqx_offload.checkpoint.filter_eval_shape` of the model and of
        `optimizer.init`, or `eqx_offload.checkpoint.abstract_init`): a step of any size plans
        without allocating one of its arrays. Nothing runs. With a sharding over
        several devices (a `NamedSharding` of a `jax.make_mesh`), the plan is for as
        many chips.
    - `target`: a GPU (`"h200"`, `"h100"` (80 GB) or an `eqx_offload.planner.GpuTarget`,
        compiled by XLA's GPU compiler) or a TPU (`"v5e"`, `"v5p"`, `"v6e"` or an
        `eqx_offload.planner.TpuTarget`, compiled by libtpu).
    - `device_memory`: plan within this many bytes of device memory instead of the
        target's (on a GPU, XLA's scheduler keeps within it where it can; on a TPU only
        `Plan.fits` reads it); `Plan.fits` says whether the step does.
    - `compiler_options`: XLA options, added to `fun`'s own and to the defaults
        `filter_jit` compiles a step for the target with (`Plan.compiler_options` lists
        them all).
    - `host_memory`: the host memory (bytes) the process driving the planned chips has
        (e.g. 2 TB for an 8-GPU node); `Plan.host_fits` then checks it as well as a
        GPU's pinned host pool.

    **Returns:**

    A `Plan`; `print(plan.summary())` for a person.

    **Raises:**

    `PlanError` if the target's compiler is not installed (for a GPU, the `plan` extra:
    `jax-cuda12-plugin` at the installed JAX version and `nvidia-cuda-nvcc-cu12`; for a
    TPU, libtpu: `jax[tpu]` at the installed JAX version), an abstract argument has no
    sharding the plan can use, or XLA cannot compile the step for the target (on a TPU,
    also a step whose temporaries alone exceed its HBM: XLA:TPU refuses to compile it);
    `OptionError` for a bad `target`, `device_memory` or `host_memory`.

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

        plan = eqx_offload.plan(step, model, state, jnp.ones((64, 256)), target="v5e")
        print(plan.summary())
        assert plan.host_bytes > 0 and plan.copies_to("to_device")
        ```
    """
    import jax
    import jax.tree_util as jtu

    from .._jit.jit import filter_jit

    resolved = resolve_target(target, device_memory)
    tpu = isinstance(resolved, TpuTarget)
    fraction, source = (
        (1.0, "the given device_memory") if device_memory is not None
        else (1.0, "the HBM XLA:TPU makes available") if tpu else client_memory_fraction())
    _check_options(compiler_options, host_memory)
    # A `filter_jit` function lowers through its public hook, `lower_for`.
    jitted = fun if callable(getattr(fun, "lower_for", None)) else filter_jit(fun)
    (_tpu if tpu else _deviceless).check_available()
    check_abstract_arguments(args, kwargs)
    shardings = [x.sharding for x in jtu.tree_leaves((args, kwargs))
                 if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))]
    n_devices = max(1, len({d for s in shardings for d in s.device_set}))
    compile_ = _compile_tpu if tpu else _compile
    lowered, options, executable = compile_(jitted, args, kwargs, resolved, n_devices,
                                            compiler_options)
    return _read_plan(executable, lowered.jaxpr, resolved, options, n_devices,
                      host_memory=host_memory, fraction=fraction, source=source)


def gpu_plan(
    fun: Callable[..., Any],
    *args: Any,
    target: Union[str, GpuTarget, TpuTarget] = "h200",
    device_memory: Optional[int] = None,
    compiler_options: Optional[dict[str, Any]] = None,
    host_memory: Optional[int] = None,
    **kwargs: Any,
) -> Plan:
    """`plan` with an H200 for the default `target` (its earlier name)."""
    return plan(fun, *args, target=target, device_memory=device_memory,
                compiler_options=compiler_options, host_memory=host_memory, **kwargs)


def _check_options(compiler_options: Any, host_memory: Any) -> None:
    """Raise an `OptionError` for a `compiler_options` or `host_memory` of `plan` that
    is not of its kind (`target` and `device_memory`: `resolve_target`)."""
    if compiler_options is not None and not isinstance(compiler_options, dict):
        raise OptionError(
            f"plan(compiler_options={compiler_options!r}): compiler_options must be a "
            "dict of XLA option names to values, or None."
        )
    if host_memory is not None and (isinstance(host_memory, bool) or not isinstance(
            host_memory, int) or host_memory <= 0):
        raise OptionError(
            f"plan(host_memory={host_memory!r}): host_memory must be an int > 0 (bytes "
            "of host memory for the planned chips together), or None."
        )


def _compile(jitted: Any, args: tuple[Any, ...], kwargs: dict[str, Any], resolved: Target,
             n_devices: int, compiler_options: Optional[dict[str, Any]],
             ) -> tuple[Any, dict[str, Any], Any]:
    """Lower the `filter_jit` call for `cuda` and compile it for `n_devices` of the
    target's compile-only topology: the lowering, the XLA options, the executable."""
    assert isinstance(resolved, GpuTarget)
    topology = _deviceless.topology(resolved.config_text(), n_devices)
    lowered = jitted.lower_for(("cuda",), args, kwargs)
    # What `filter_jit` compiles with on a GPU: its defaults, its own options, these.
    options = {**lowered.compiler_options, **(compiler_options or {})}
    try:
        executable = _deviceless.compile_for(lowered, list(topology.devices[:n_devices]),
                                             options)
    except Exception as error:
        raise PlanError(f"plan: XLA could not compile the step for {resolved.name}: "
                        f"{error}") from error
    return lowered, options, _Stats(executable.get_compiled_memory_stats(), "\n".join(
        m.to_string() for m in executable.hlo_modules()))


def _compile_tpu(jitted: Any, args: tuple[Any, ...], kwargs: dict[str, Any], resolved: Target,
                 n_devices: int, compiler_options: Optional[dict[str, Any]],
                 ) -> tuple[Any, dict[str, Any], Any]:
    """Lower the `filter_jit` call for `tpu` with its arguments on the first `n_devices`
    chips of the target's topology, and compile it with libtpu."""
    assert isinstance(resolved, TpuTarget)
    chips = _tpu.devices(resolved.topologies, n_devices)
    try:
        lowered, options, compiled = _tpu.compile_for(jitted, args, kwargs, chips,
                                                      compiler_options or {})
    except PlanError:
        raise
    except Exception as error:
        fit = (" (the step does not fit in the chip's HBM: XLA:TPU refuses a step whose "
               "temporaries exceed it)" if "RESOURCE_EXHAUSTED" in str(error) else "")
        raise PlanError(f"plan: XLA could not compile the step for {resolved.name}"
                        f"{fit}: {error}") from error
    return lowered, options, _Stats(compiled.get_compiled_memory_stats(), "\n".join(
        m.to_string() for m in compiled.hlo_modules()))


@dataclasses.dataclass(frozen=True)
class _Stats:
    """What a plan reads of a compiled step: XLA's memory statistics, its HLO text."""

    memory: Any
    text: str


def _read_plan(executable: _Stats, jaxpr: Any, resolved: Target, options: dict[str, Any],
               n_devices: int, *, host_memory: Optional[int], fraction: float,
               source: str) -> Plan:
    """The `Plan` of a compiled step: XLA's memory statistics, the copies and
    collectives of its scheduled HLO, and the flops of the traced program (`jaxpr`)."""
    stats, text = executable.memory, executable.text
    device_peak = (stats.argument_size_in_bytes + stats.temp_size_in_bytes
                   + stats.output_size_in_bytes - stats.alias_size_in_bytes)
    host = (stats.host_argument_size_in_bytes + stats.host_temp_size_in_bytes
            + stats.host_output_size_in_bytes - stats.host_alias_size_in_bytes)
    copies = scheduled_copies(text)
    hbm = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           + sum(c.nbytes * c.count for c in copies))
    return Plan(
        target=resolved.name,
        device_memory_size=resolved.device_memory_size,
        device_peak_bytes=int(device_peak),
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        host_bytes=int(host),
        host_limit_bytes=(None if isinstance(resolved, TpuTarget)
                          else _deviceless.host_pool_limit_bytes()),
        copies=copies,
        compiler_options=options,
        n_devices=n_devices,
        host_memory_bytes=host_memory,
        collectives=scheduled_collectives(text),
        matmul_flops={kind: n / n_devices for kind, n in matmul_flops(jaxpr).items()},
        hbm_bytes=int(hbm),
        chip=resolved,
        memory_fraction=fraction,
        memory_fraction_source=source,
    )


def check_abstract_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise a `PlanError` naming the argument's path for a `jax.ShapeDtypeStruct`
    without a sharding, or with one on devices that are not this process's (e.g. a
    compile-only topology's, whose devices the plan picks itself)."""
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
                f"plan: the abstract argument {where} ({shape}) has no sharding, so the "
                "plan cannot tell which device or memory it is in. Give it one, e.g. "
                "`eqx_offload.checkpoint.restore_target(tree)` (every leaf on the default device, "
                "`where=` to host memory) or `jax.ShapeDtypeStruct(shape, dtype, sharding="
                "jax.sharding.NamedSharding(mesh, spec, memory_kind=...))`; "
                "`eqx_offload.checkpoint.filter_eval_shape` keeps the shardings a function gives."
            )
        if not isinstance(leaf.sharding, jax.sharding.Sharding) or not set(
                leaf.sharding.device_set) <= local:
            raise PlanError(
                f"plan: the abstract argument {where} ({shape}) has the sharding "
                f"{leaf.sharding!r}, whose devices are not this process's "
                f"({jax.devices()[0].platform} devices). The plan lowers with shardings on "
                "this machine's devices (they carry memory kinds; the chip is described "
                "by `target=`): build the sharding over `jax.devices()`, e.g. "
                "`jax.make_mesh(...)` (for several chips on a CPU machine, set "
                "`jax_num_cpu_devices` before JAX starts)."
            )


"""`Plan`: what XLA's plan of a step holds and moves on a GPU or a TPU target, and
what follows from it (whether it fits, the floors of its time). Made by `plan.plan`;
its text for a person is `summary`'s."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, Optional

from .._core.memory import run_settings
from .hlo import Direction, PlannedCollective, PlannedCopy
from .kernels import PlannedKernel
from .summary import summary_text
from .targets import GPU_TARGETS, GpuTarget, Target


@dataclasses.dataclass(frozen=True)
class Plan:
    """XLA's plan for one step on a GPU or TPU target (see `plan`). XLA's numbers, not a
    measurement.

    **Fields:**

    - `target`: the chip's name; `device_memory_size`: the device memory XLA planned
        within (bytes; for a TPU, the HBM XLA:TPU lets a program use).
    - `device_peak_bytes`: the device memory XLA needs for the step: arguments +
        temporaries + outputs - outputs aliased to donated arguments. The temporaries
        are one reservation XLA sizes for its schedule (on a TPU, what XLA:TPU checks
        against the HBM, `RESOURCE_EXHAUSTED`), not the bytes live at one instant. A
        chip's `jax.Device.memory_stats()["peak_bytes_in_use"]` is another figure: the
        arrays the runtime allocated (arguments, outputs, and any made before the
        step), without the program's temporaries (measured on a v5e,
        `docs/gpu-plan.md`).
    - `argument_bytes`, `output_bytes`, `alias_bytes`, `temp_bytes`: its parts (device).
    - `host_bytes`: host memory of its arguments, outputs and temporaries (less
        aliasing), for one device; its parts `host_argument_bytes`,
        `host_output_bytes`, `host_alias_bytes` (host outputs that reuse a donated
        host argument's buffer), `host_temp_bytes`. Where every host output aliases its
        donated input, `host_bytes` is the host arguments plus the host temporaries
        (e.g. layer inputs kept for the backward pass); `unaliased_host_output_bytes`
        says how many do not. `host_limit_bytes`: on a GPU, the pinned host pool
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
    - `predicted_step_seconds`: on a TPU, the step time the calibrated schedule model
        predicts from this plan (`timing.predict_seconds`; `docs/results.md` gives its
        error against the chip); `None` for a GPU. A model, not a measurement.
    - `kernels`: on a TPU, the device work of XLA:TPU's schedule (its estimated
        cycles, and its loops) that the prediction replays beside the copies.
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
    host_argument_bytes: int = 0
    host_output_bytes: int = 0
    host_alias_bytes: int = 0
    host_temp_bytes: int = 0
    predicted_step_seconds: Optional[float] = None
    kernels: tuple[PlannedKernel, ...] = ()

    @property
    def unaliased_host_output_bytes(self) -> int:
        """Host outputs that do not reuse a donated host argument's buffer: each step
        allocates them anew, and the device writes into new host memory slowly (0.47
        GB/s on a v5e against 14 GB/s into a donated buffer, `docs/gpu-plan.md`)."""
        return self.host_output_bytes - self.host_alias_bytes

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
        """A few lines for a person: peak, host bytes, copies, overlap (`summary_text`)."""
        return summary_text(self)

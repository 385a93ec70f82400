"""The chips `plan` compiles for: `GpuTarget` (the properties XLA's GPU compiler reads,
and the peak rates the plan's floors use) and `GPU_TARGETS` by name; `TpuTarget` (the
libtpu topology that describes the chip, and its rates) and `TPU_TARGETS` by name.
See `docs/gpu-plan.md` for what the plans of these targets show.
"""

import dataclasses
from collections.abc import Mapping
from typing import Optional, Union

from .._core.errors import OptionError


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """An NVIDIA GPU that `plan` compiles for: the properties of XLA's GPU target
    description (`stream_executor.GpuTargetConfigProto`) that its cost model and
    scheduler read. `device_memory_size` is also the memory limit XLA's scheduler
    plans within.

    **Fields:** `name`, `device_memory_size` (bytes), `core_count` (SMs),
    `memory_bandwidth` (bytes/s), `clock_rate_ghz`, `l2_cache_size` (bytes),
    `compute_capability` (`(major, minor)`), `pcie_bandwidth` (bytes/s, the value of
    XLA's own target description, which its cost model reads). The step's floors
    (`Plan.compute_floor_seconds`, `Plan.transfer_floor_seconds`) read the
    published peak rates: `bf16_flops`, `tf32_flops` (a float32 matrix product at
    JAX's default precision, which lets cuBLAS use TF32 on these GPUs), `fp32_flops`
    (at `precision=HIGHEST`), all dense, per second; and `host_link_bandwidth`, bytes
    per second each way between host and device (PCIe 5.0 x16: 64 GB/s). How these
    floors compare with a step measured on an H200: `docs/gpu-plan.md`.
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
"""The GPUs `plan` knows by name (`"h100"`: H100 SXM 80 GB; `"h200"`: H200 141 GB),
with their published properties as XLA's own target descriptions give them. For
another GPU, or a budget, make a `GpuTarget` (or `GPU_TARGETS["h200"].with_memory(n)`)."""



@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """A Google TPU chip that `plan` compiles for through libtpu, without one: the
    topologies libtpu describes it by (`jax.experimental.topologies.get_topology_desc(
    platform="tpu", topology_name=...)`), smallest first; a plan of `n` chips compiles
    for the first `n` chips of the first topology that has as many.

    **Fields:** `name` (JAX's `device_kind` for the chip, e.g. `"TPU v5 lite"`),
    `topologies`, `device_memory_size` (bytes: the HBM XLA:TPU lets one program use, as
    its `RESOURCE_EXHAUSTED` message states it, rounded there to 0.01 GiB; it can differ
    by that much between libtpu versions), and, for the
    plan's floors, the published peak rates: `bf16_flops` (dense, per second);
    `tf32_flops` (a float32 matrix product at JAX's default precision, one bfloat16 pass
    on a TPU: the bf16 rate); `fp32_flops` (at `precision=HIGHEST`, six bfloat16 passes);
    `memory_bandwidth` (HBM, bytes/s); `host_link_bandwidth` (bytes per second each
    way between host and chip: 14 GB/s, the host-to-device copies measured on a v5e on
    2026-12-05, `bench/results/tpu-v5e-2026-12-05/`; not measured on the others).
    """

    name: str
    topologies: tuple[str, ...]
    device_memory_size: int
    bf16_flops: float
    memory_bandwidth: int
    host_link_bandwidth: float = 14e9

    @property
    def tf32_flops(self) -> float:
        """A float32 matrix product at JAX's default precision: one bfloat16 pass."""
        return self.bf16_flops

    @property
    def fp32_flops(self) -> float:
        """A float32 matrix product at `precision=HIGHEST`: six bfloat16 passes."""
        return self.bf16_flops / 6

    def with_memory(self, device_memory_size: int) -> "TpuTarget":
        """The same chip with `device_memory_size` bytes of device memory (a budget that
        `Plan.fits` checks; XLA:TPU still compiles within the chip's own HBM)."""
        return dataclasses.replace(self, device_memory_size=int(device_memory_size))


TPU_TARGETS: Mapping[str, TpuTarget] = {
    "v5e": TpuTarget("TPU v5 lite", ("v5e:2x2", "v5e:2x4", "v5e:4x4", "v5e:8x8"),
                     16911433728, 197e12, 819000000000),
    "v5p": TpuTarget("TPU v5", ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4"),
                     102789304811, 459e12, 2765000000000),
    "v6e": TpuTarget("TPU v6 lite", ("v6e:2x2", "v6e:2x4", "v6e:4x4"),
                     33543694581, 918e12, 1640000000000),
}
"""The TPUs `plan` knows by name (`"v5e"`, `"v5p"`, `"v6e"`), with the HBM XLA:TPU
makes available to a program (15.75, 95.73 and 31.24 GiB: the libtpu of JAX 0.12's;
that of JAX 0.10.2 gives 0.01 GiB more on a v5p and a v6e) and Google's published peak
rates. For a budget, `TPU_TARGETS["v5e"].with_memory(n)`."""

Target = Union[GpuTarget, TpuTarget]




def resolve_target(target: Union[str, Target], device_memory: Optional[int]) -> Target:
    """The target of `plan(target=..., device_memory=...)`, or an `OptionError`."""
    resolved: Target
    if isinstance(target, (GpuTarget, TpuTarget)):
        resolved = target
    elif isinstance(target, str) and target.lower() in GPU_TARGETS:
        resolved = GPU_TARGETS[target.lower()]
    elif isinstance(target, str) and target.lower() in TPU_TARGETS:
        resolved = TPU_TARGETS[target.lower()]
    else:
        names = ", ".join(repr(t) for t in (*GPU_TARGETS, *TPU_TARGETS))
        raise OptionError(
            f"plan(target={target!r}): target must be one of {names}, an "
            "eqx_offload.planner.GpuTarget or an eqx_offload.planner.TpuTarget."
        )
    if device_memory is not None:
        if isinstance(device_memory, bool) or not isinstance(device_memory, int) or device_memory <= 0:
            raise OptionError(
                f"plan(device_memory={device_memory!r}): device_memory must be an int > 0 "
                "(bytes of device memory to plan within), or None for the target's own."
            )
        resolved = resolved.with_memory(device_memory)
    return resolved

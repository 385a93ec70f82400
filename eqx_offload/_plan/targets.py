"""The NVIDIA GPUs `gpu_plan` compiles for: `GpuTarget` (the properties XLA's GPU
compiler reads, and the peak rates the plan's floors use) and `GPU_TARGETS` by name.
See `docs/gpu-plan.md` for what the plans of these targets show.
"""

import dataclasses
from collections.abc import Mapping
from typing import Optional, Union

from .._core.errors import OptionError


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
"""The GPUs `gpu_plan` knows by name (`"h100"`: H100 SXM 80 GB; `"h200"`: H200 141 GB),
with their published properties as XLA's own target descriptions give them. For
another GPU, or a budget, make a `GpuTarget` (or `GPU_TARGETS["h200"].with_memory(n)`)."""



def resolve_target(target: Union[str, GpuTarget], device_memory: Optional[int]) -> GpuTarget:
    """The `GpuTarget` of `gpu_plan(target=..., device_memory=...)`, or an `OptionError`."""
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


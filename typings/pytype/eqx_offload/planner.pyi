# The planner's public names (`eqx_offload.planner`), for pytype users; kept in step
# with the code by `mypy.stubtest` (scripts/gates.sh), as `__init__.pyi` is.
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, Optional, Union

__all__ = [
    "GPU_TARGETS",
    "GpuTarget",
    "gpu_plan",
    "Plan",
    "plan",
    "PlannedCollective",
    "PlannedCopy",
    "plan_startup",
    "RUNTIME_HOST_BYTES",
    "StartupPlan",
    "TPU_TARGETS",
    "TpuTarget",
]

@dataclasses.dataclass(frozen=True)
class GpuTarget:
    name: str
    device_memory_size: int
    core_count: int
    memory_bandwidth: int
    clock_rate_ghz: float
    l2_cache_size: int
    compute_capability: tuple[int, int]
    pcie_bandwidth: int
    bf16_flops: float = ...
    tf32_flops: float = ...
    fp32_flops: float = ...
    host_link_bandwidth: float = ...
    def with_memory(self, device_memory_size: int) -> GpuTarget: ...
    def config_text(self) -> str: ...

GPU_TARGETS: Mapping[str, GpuTarget]

@dataclasses.dataclass(frozen=True)
class TpuTarget:
    name: str
    topologies: tuple[str, ...]
    device_memory_size: int
    bf16_flops: float
    memory_bandwidth: int
    host_link_bandwidth: float = ...
    @property
    def tf32_flops(self) -> float: ...
    @property
    def fp32_flops(self) -> float: ...
    def with_memory(self, device_memory_size: int) -> TpuTarget: ...

TPU_TARGETS: Mapping[str, TpuTarget]

@dataclasses.dataclass(frozen=True)
class PlannedCopy:
    direction: Literal["to_device", "to_host"]
    nbytes: int
    overlapped: bool
    kernels: int
    name: str
    count: int = ...
    conditional: bool = ...
    computation: str = ...
    start: int = ...
    done: int = ...

@dataclasses.dataclass(frozen=True)
class PlannedCollective:
    kind: str
    nbytes: int
    count: int
    name: str

@dataclasses.dataclass(frozen=True)
class Plan:
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
    n_devices: int = ...
    host_memory_bytes: Optional[int] = ...
    collectives: tuple[PlannedCollective, ...] = ...
    matmul_flops: Mapping[str, float] = ...
    hbm_bytes: int = ...
    chip: Union[GpuTarget, TpuTarget, None] = ...
    memory_fraction: float = ...
    memory_fraction_source: str = ...
    host_argument_bytes: int = ...
    host_output_bytes: int = ...
    host_alias_bytes: int = ...
    host_temp_bytes: int = ...
    predicted_step_seconds: Optional[float] = ...
    kernels: tuple[Any, ...] = ...
    @property
    def unaliased_host_output_bytes(self) -> int: ...
    @property
    def gpu(self) -> Optional[GpuTarget]: ...
    @property
    def usable_device_bytes(self) -> int: ...
    @property
    def fits(self) -> bool: ...
    @property
    def host_total_bytes(self) -> int: ...
    @property
    def host_fits(self) -> bool: ...
    def bytes_moved(self, direction: Literal["to_device", "to_host"]) -> int: ...
    @property
    def compute_floor_seconds(self) -> float: ...
    @property
    def transfer_floor_seconds(self) -> float: ...
    @property
    def floor_ratio(self) -> float: ...
    def copies_to(self, direction: Literal["to_device", "to_host"]) -> tuple[PlannedCopy, ...]: ...
    def overlapped_fraction(
        self,
        direction: Optional[Literal["to_device", "to_host"]] = None,
        *,
        by: Literal["count", "bytes"] = "count",
    ) -> float: ...
    def run_settings(self) -> list[str]: ...
    def summary(self) -> str: ...

def plan(
    fun: Callable[..., Any],
    *args: Any,
    target: Union[str, GpuTarget, TpuTarget],
    device_memory: Optional[int] = None,
    compiler_options: Optional[dict[str, Any]] = None,
    host_memory: Optional[int] = None,
    **kwargs: Any,
) -> Plan: ...

RUNTIME_HOST_BYTES: dict[str, int]

@dataclasses.dataclass(frozen=True)
class StartupPlan:
    programs: tuple[tuple[str, int, Plan], ...]
    device_peak_bytes: int
    device_memory_bytes: int
    host_array_bytes: int
    host_peak_bytes: int
    runtime_host_bytes: int
    host_memory_bytes: Optional[int]
    @property
    def fits(self) -> bool: ...
    def summary(self) -> str: ...

def plan_startup(
    fun: Callable[..., Any],
    *args: Any,
    target: Union[str, GpuTarget, TpuTarget],
    host_memory: Optional[int] = None,
    runtime_host_memory: Optional[int] = None,
    group_bytes: int = ...,
    **kwargs: Any,
) -> StartupPlan: ...

def gpu_plan(
    fun: Callable[..., Any],
    *args: Any,
    target: Union[str, GpuTarget, TpuTarget] = "h200",
    device_memory: Optional[int] = None,
    compiler_options: Optional[dict[str, Any]] = None,
    host_memory: Optional[int] = None,
    **kwargs: Any,
) -> Plan: ...

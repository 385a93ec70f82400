# eqx_offload.memory, for pytype users: see __init__.pyi.

import dataclasses
from typing import Any, Optional

import jax

@dataclasses.dataclass(frozen=True)
class LeafMemory:
    path: str
    memory_kind: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str

@dataclasses.dataclass(frozen=True)
class MemoryReport:
    by_kind: dict[str, int]
    leaves: tuple[LeafMemory, ...]
    host_pool_bytes: int = 0
    host_pool_limit: Optional[int] = None
    @property
    def device_bytes(self) -> int: ...
    @property
    def host_bytes(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    def __rich__(self) -> Any: ...

def memory_report(tree: Any) -> MemoryReport: ...

def supported_memory_kinds(device: Optional[jax.Device] = None) -> tuple[str, ...]: ...

__all__ = [
    "LeafMemory",
    "memory_report",
    "MemoryReport",
    "supported_memory_kinds",
]

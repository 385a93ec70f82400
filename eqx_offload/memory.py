"""Where bytes live: `memory_report` (also at the top level) with its `MemoryReport`
and `LeafMemory`, and the memory kinds a device offers (`supported_memory_kinds`).
"""

from ._core.memory import supported_memory_kinds as supported_memory_kinds
from ._report import (
    LeafMemory as LeafMemory,
    memory_report as memory_report,
    MemoryReport as MemoryReport,
)


__all__ = ["LeafMemory", "memory_report", "MemoryReport", "supported_memory_kinds"]

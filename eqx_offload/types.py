"""The types in `eqx_offload`'s signatures, for annotating a program: the option
literals, the `where` filters' types, and the classes its functions return.
"""

from ._core.types import (
    Donate as Donate,
    HostMemoryKind as HostMemoryKind,
    MemoryKind as MemoryKind,
    Nested as Nested,
    Where as Where,
)
from ._core.where import Filter as Filter
from ._jit.jit import Compiled as Compiled, Lowered as Lowered
from ._models.backward import BackwardUpdate as BackwardUpdate
from ._models.master import MasterState as MasterState, MasterWeights as MasterWeights
from ._models.params import HostWeights as HostWeights, HostWeightsOptimizer as HostWeightsOptimizer
from ._optim.backward import BackwardState as BackwardState
from ._optim.options import Compute as Compute


__all__ = [
    "BackwardState",
    "BackwardUpdate",
    "Compiled",
    "Compute",
    "Donate",
    "Filter",
    "HostMemoryKind",
    "HostWeights",
    "HostWeightsOptimizer",
    "Lowered",
    "MasterState",
    "MasterWeights",
    "MemoryKind",
    "Nested",
    "Where",
]

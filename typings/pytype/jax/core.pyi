from typing import Any

import numpy as _np

from jax import Array, _MemorySpace
from jax.sharding import Sharding

class Tracer(Array):
    aval: Any

class AbstractValue: ...

class ShapedArray(AbstractValue):
    shape: tuple[int, ...]
    dtype: _np.dtype[Any]
    @property
    def ndim(self) -> int: ...
    @property
    def size(self) -> int: ...
    weak_type: bool
    memory_space: _MemorySpace
    sharding: Sharding
    def __init__(self, shape: tuple[int, ...], dtype: Any, weak_type: bool = False) -> None: ...

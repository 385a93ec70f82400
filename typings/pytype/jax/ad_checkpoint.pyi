# What eqx_offload's remat policies and scanned layers use of `jax.ad_checkpoint`.
from typing import Any, NamedTuple, TypeVar

_T = TypeVar("_T")

def checkpoint_name(x: _T, name: str) -> _T: ...

class Saveable: ...
class Recompute: ...

class Offloadable(NamedTuple):
    src: str
    dst: str

checkpoint_policies: Any

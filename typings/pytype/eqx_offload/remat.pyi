# eqx_offload.remat, for pytype users: see __init__.pyi.

from collections.abc import Callable
from typing import Any, Optional, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

Policy = Callable[..., Any]
LAYER_INPUT: str

def offload_names(*names: str, save: tuple[str, ...] = ()) -> Policy: ...
def offload_regex(offload: Optional[str], *, save: Optional[str] = None) -> Policy: ...
def offload_dots() -> Policy: ...
def filter_remat(fun: _F, policy: Optional[Policy] = None, *, prevent_cse: bool = True) -> _F: ...

__all__ = [
    "filter_remat",
    "LAYER_INPUT",
    "offload_dots",
    "offload_names",
    "offload_regex",
    "Policy",
]

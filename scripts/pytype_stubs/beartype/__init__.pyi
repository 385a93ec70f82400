# The part of beartype that eqx_offload._runtime uses, for the pytype gate only (users'
# code is not checked against it: not shipped).
from typing import Any, TypeVar

_T = TypeVar("_T")

def beartype(obj: _T, *args: Any, **kwargs: Any) -> _T: ...
def __getattr__(name: str) -> Any: ...

from collections.abc import Callable
from typing import Any, Literal, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

def compute_on(compute_type: Literal["device_host", "device", "tpu_sparsecore"]) -> Callable[[_F], _F]: ...

# eqx_offload.stream, for pytype users: see __init__.pyi.

import dataclasses
from typing import Any, Optional, Union

import optax

def within_budget(
    inner: optax.GradientTransformation, params: Any, device_bytes: int
) -> Any: ...  # a pytree of bools shaped like `inner.init(params)`: a `where`
def prefetch_options(
    device_bytes: Optional[int] = None, *, device_memory_size: Optional[int] = None
) -> dict[str, Any]: ...

@dataclasses.dataclass(frozen=True)
class StreamPlan:
    groups: tuple[tuple[str, ...], ...]
    group_nbytes: tuple[int, ...]
    prologue: tuple[str, ...]
    resident: tuple[str, ...]
    @property
    def max_group_nbytes(self) -> int: ...
    @property
    def total_nbytes(self) -> int: ...

def stream_plan(
    inner: Any,
    updates: Any,
    inner_state: Any,
    params: Any = None,
    *,
    group_bytes: Union[int, str] = "auto",
    **extra_args: Any,
) -> StreamPlan: ...

__all__ = [
    "prefetch_options",
    "stream_plan",
    "StreamPlan",
    "within_budget",
]

# eqx_offload.checkpoint, for pytype users: see __init__.pyi.

from collections.abc import Callable
from typing import Any, BinaryIO, Optional, TypeVar, Union

import optax

from eqx_offload.types import (
    BackwardUpdate, HostMemoryKind, HostWeightsOptimizer, MasterWeights, Where,
)

_T = TypeVar("_T")

def host_shardings(
    tree: Any, where: Where = True, *, memory_kind: HostMemoryKind = "pinned_host"
) -> Any: ...
def restore_target(
    tree: _T, where: Where = False, *, memory_kind: HostMemoryKind = "pinned_host"
) -> _T: ...
def abstract_init(
    optimizer: Union[optax.GradientTransformation, HostWeightsOptimizer[Any], MasterWeights[Any],
                     BackwardUpdate[Any]],
    params: Any,
) -> Any: ...
def deserialise_filter_spec(f: BinaryIO, x: Any) -> Any: ...
def tree_deserialise_leaves(
    path_or_file: Any,
    like: _T,
    filter_spec: Callable[[BinaryIO, Any], Any] = ...,
    is_leaf: Optional[Callable[[Any], bool]] = None,
) -> _T: ...
def filter_eval_shape(fun: Callable[..., _T], *args: Any, **kwargs: Any) -> _T: ...

__all__ = [
    "abstract_init",
    "deserialise_filter_spec",
    "filter_eval_shape",
    "host_shardings",
    "restore_target",
    "tree_deserialise_leaves",
]

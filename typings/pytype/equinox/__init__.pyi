# Stubs for the part of `equinox` that eqx_offload and a typical training script use.
# Read by pytype (`--pythonpath=$(python -m eqx_offload typings)`); mypy reads equinox's own inline types.
# Names not declared here are `Any` (`__getattr__` below).
from collections.abc import Callable
from typing import Any, Generic, Literal, Optional, ParamSpec, TypeVar, Union, dataclass_transform, overload

import jax



from jax import Array, Device
from jax.sharding import Sharding

from equinox import nn as nn

_T = TypeVar("_T")
_P = ParamSpec("_P")
_F = TypeVar("_F", bound=Callable[..., Any])

_Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]
_FilterSpec = Any  # a bool, a callable on a leaf, or a pytree prefix of those
_IsLeaf = Optional[Callable[[Any], bool]]

def field(
    *,
    converter: Optional[Callable[[Any], Any]] = None,
    static: bool = False,
    default: Any = ...,
    default_factory: Optional[Callable[[], Any]] = None,
    init: bool = True,
    repr: bool = True,
    metadata: Optional[dict[str, Any]] = None,
) -> Any: ...

@dataclass_transform(field_specifiers=(field,))
class Module:
    def __init_subclass__(cls, *, strict: Optional[bool] = None, **kwargs: Any) -> None: ...

class AbstractVar: ...

def is_array(element: Any) -> bool: ...
def is_array_like(element: Any) -> bool: ...
def is_inexact_array(element: Any) -> bool: ...
def is_inexact_array_like(element: Any) -> bool: ...

def partition(
    pytree: _T, filter_spec: _FilterSpec, replace: Any = None, is_leaf: _IsLeaf = None
) -> tuple[_T, _T]: ...
def combine(*pytrees: _T, is_leaf: _IsLeaf = None) -> _T: ...
def filter(
    pytree: _T,
    filter_spec: _FilterSpec,
    inverse: bool = False,
    replace: Any = None,
    is_leaf: _IsLeaf = None,
) -> _T: ...
def apply_updates(model: _T, updates: Any) -> _T: ...
def tree_at(
    where: Callable[[_T], Any],
    pytree: _T,
    replace: Any = ...,
    replace_fn: Callable[[Any], Any] = ...,
    is_leaf: _IsLeaf = None,
) -> _T: ...
def tree_equal(
    *pytrees: Any, typematch: bool = False, rtol: Any = 0.0, atol: Any = 0.0
) -> Union[bool, Array]: ...
def filter_shard(x: _T, device_or_shardings: Union[Device, Sharding, Any]) -> _T: ...
def filter_eval_shape(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...

class Compiled(Module):
    compiled: jax.stages.Compiled
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

class Lowered(Module):
    lowered: jax.stages.Lowered
    def as_text(self) -> str: ...
    def compile(self, compiler_options: Optional[dict[str, Union[str, bool]]] = None) -> Compiled: ...

class _JitWrapper(Module, Generic[_P, _T]):
    # What `filter_jit` returns: callable as the wrapped function, plus `.lower(...)`.
    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _T: ...
    def lower(self, *args: Any, **kwargs: Any) -> Lowered: ...

@overload
def filter_jit(*, donate: _Donate = "none") -> Callable[[Callable[_P, _T]], _JitWrapper[_P, _T]]: ...
@overload
def filter_jit(fun: Callable[_P, _T], *, donate: _Donate = "none") -> _JitWrapper[_P, _T]: ...

@overload
def filter_grad(*, has_aux: bool = False) -> Callable[[Callable[_P, Any]], Callable[_P, Any]]: ...
@overload
def filter_grad(fun: Callable[_P, Any], *, has_aux: bool = False) -> Callable[_P, Any]: ...

@overload
def filter_value_and_grad(
    *, has_aux: bool = False
) -> Callable[[Callable[_P, _T]], Callable[_P, tuple[_T, Any]]]: ...
@overload
def filter_value_and_grad(
    fun: Callable[_P, _T], *, has_aux: bool = False
) -> Callable[_P, tuple[_T, Any]]: ...

def filter_vmap(
    fun: _F = ...,
    *,
    in_axes: Any = ...,
    out_axes: Any = ...,
    axis_name: Any = None,
    axis_size: Optional[int] = None,
) -> _F: ...
def filter_checkpoint(
    fun: Callable[_P, _T] = ..., *, prevent_cse: bool = True, policy: Optional[Callable[..., bool]] = None
) -> Callable[_P, _T]: ...
def tree_serialise_leaves(path_or_file: Any, pytree: Any, filter_spec: Any = ..., is_leaf: _IsLeaf = None) -> None: ...
def tree_deserialise_leaves(path_or_file: Any, like: _T, filter_spec: Any = ..., is_leaf: _IsLeaf = None) -> _T: ...
def clear_caches() -> None: ...
def __getattr__(name: str) -> Any: ...

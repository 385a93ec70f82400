# Stubs for jaxtyping, for pytype. (mypy reads jaxtyping's own `py.typed` package.)
#
# mypy reads `Float[Array, "n"]` as `Array` because jaxtyping aliases the dtype names to
# `typing.Annotated` for static checkers. pytype cannot: it treats the string `"n"` in a
# subscript as a forward reference, and an alias of `Annotated` in a stub is not
# subscriptable for it. So here every dtype name is `Any`: pytype checks nothing about
# `Float[...]`-annotated values (use `jax.Array` in signatures where pytype should check),
# and `PyTree[...]` is `Any` for every static checker, as jaxtyping intends.
from collections.abc import Callable, Sequence
from typing import Any, Optional, TypeVar, Union, overload

from jax import Array as Array
from jax.tree_util import PyTreeDef as PyTreeDef
from jax.typing import ArrayLike as ArrayLike, DTypeLike as DTypeLike

_F = TypeVar("_F", bound=Callable[..., Any])

PRNGKeyArray = Array
Scalar = Array
ScalarLike = ArrayLike
PyTree = Any

Shaped = Any
Bool = Any
Num = Any
Real = Any
Inexact = Any
Float = Any
Float16 = Any
Float32 = Any
Float64 = Any
BFloat16 = Any
Complex = Any
Complex64 = Any
Complex128 = Any
Integer = Any
Int = Any
Int8 = Any
Int16 = Any
Int32 = Any
Int64 = Any
UInt = Any
UInt8 = Any
UInt16 = Any
UInt32 = Any
UInt64 = Any
Key = Any

class AbstractArray: ...
class AbstractDtype: ...
class AnnotationError(Exception): ...
class TypeCheckError(TypeError): ...

@overload
def jaxtyped(*, typechecker: Any) -> Callable[[_F], _F]: ...
@overload
def jaxtyped(fn: _F, *, typechecker: Any = ...) -> _F: ...

class ImportHook:
    def __enter__(self) -> ImportHook: ...
    def __exit__(self, *args: object) -> None: ...
    def uninstall(self) -> None: ...

def install_import_hook(
    modules: Union[str, Sequence[str]], typechecker: Optional[str]
) -> ImportHook: ...
def print_bindings() -> None: ...

class _Config:
    jaxtyping_disable: bool
    jaxtyping_remove_typechecker_stack: bool
    def update(self, item: str, value: Any) -> None: ...

config: _Config

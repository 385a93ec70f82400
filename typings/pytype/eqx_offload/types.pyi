# eqx_offload.types, for pytype users: see __init__.pyi.

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, Literal, NamedTuple, Optional, TypeVar, Union

import equinox as eqx
import jax
import optax

from eqx_offload.remat import Policy

_T = TypeVar("_T")
_M = TypeVar("_M")

Nested = Union[_T, Mapping[Any, "Nested[_T]"], list["Nested[_T]"], tuple["Nested[_T]", ...]]
MemoryKind = Literal["device", "pinned_host", "unpinned_host"]
HostMemoryKind = Literal["pinned_host", "unpinned_host"]
Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]
Where = Nested[Union[bool, Callable[[Any], bool], eqx.Module, None]]
Compute = Literal["device", "host"]

class Filter:
    def __call__(self, leaf: Any, path: str = "") -> bool: ...
    def __and__(self, other: Callable[[Any], bool]) -> Filter: ...
    def __rand__(self, other: Callable[[Any], bool]) -> Filter: ...
    def __or__(self, other: Callable[[Any], bool]) -> Filter: ...
    def __ror__(self, other: Callable[[Any], bool]) -> Filter: ...
    def __invert__(self) -> Filter: ...

class Compiled:
    def __init__(self, executable: Any, key: Any, donate: Any, name: str,
                 fun_arrays: Any = None) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def memory_analysis(self) -> Any: ...
    def cost_analysis(self) -> Any: ...
    def as_text(self) -> Optional[str]: ...
    def serialize(self) -> bytes: ...

class Lowered:
    jaxpr: Any
    compiler_options: dict[str, Any]
    def __init__(self, program: Any, key: Any, donate: Any, name: str,
                 fun_arrays: Any = None) -> None: ...
    def compile(self, compiler_options: Optional[dict[str, Any]] = None) -> Compiled: ...
    def as_text(self) -> str: ...
    def compiler_ir(self, dialect: str = "stablehlo") -> Any: ...


class HostWeights(eqx.Module, Generic[_M]):
    module: _M
    policy: Optional[Policy] = None
    # Set by Equinox's metaclass on every Module subclass (class variables, not fields).
    __abstractvars__: ClassVar[frozenset[str]]
    __abstractclassvars__: ClassVar[frozenset[str]]
    def __init__(self, module: _M, policy: Optional[Policy] = None) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

@dataclasses.dataclass(frozen=True)
class HostWeightsOptimizer(Generic[_M]):
    transformation: optax.GradientTransformationExtraArgs
    def init(self, model: Any) -> Any: ...
    def update(self, grads: Any, state: Any, model: _M, **extra_args: Any) -> tuple[_M, Any]: ...

class BackwardState(NamedTuple):
    layers: Any
    rest: Any

class BackwardUpdate(Generic[_M]):
    optimizer: Union[optax.GradientTransformation, MasterWeights[Any], HostWeightsOptimizer[Any],
                     optax.MultiSteps]
    layers: Callable[[Any], Any]
    offload: Optional[Callable[[optax.GradientTransformation], optax.GradientTransformation]]
    def __init__(
        self,
        optimizer: Union[optax.GradientTransformation, MasterWeights[Any],
                         HostWeightsOptimizer[Any], optax.MultiSteps],
        layers: Callable[[Any], Any],
        offload: Optional[
            Callable[[optax.GradientTransformation], optax.GradientTransformation]
        ] = ...,
    ) -> None: ...
    def init(self, model: _M) -> tuple[_M, BackwardState]: ...
    def step(self, loss: Callable[..., jax.Array], model: _M, state: BackwardState, *args: Any,
             accumulated: Optional[_M] = ...,
             **kwargs: Any) -> tuple[jax.Array, _M, BackwardState]: ...

class MasterState(NamedTuple):
    master: Any
    inner_state: Any

@dataclasses.dataclass(frozen=True)
class MasterWeights(Generic[_M]):
    transformation: optax.GradientTransformationExtraArgs
    compute_dtype: Any
    def init(self, model: _M) -> tuple[_M, Any]: ...
    def update(self, grads: Any, state: Any, model: _M, **extra_args: Any) -> tuple[_M, Any]: ...

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

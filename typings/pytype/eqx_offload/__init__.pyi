# The public API of eqx_offload, for pytype users: `pytype-single
# --pythonpath=$(python -m eqx_offload typings) ...` reads it, with the stubs of jax,
# equinox, optax and jaxtyping that these signatures refer to. mypy, pyright and pyrefly
# users need none of this: the package ships `py.typed` (mypy users add
# `python -m eqx_offload typings --mypy` to `mypy_path`, for optax).
#
# Kept in step with the code by `mypy.stubtest` (scripts/gates.sh; with `__all__` it
# also fails on a public name missing here). The submodules' stubs are beside this one.
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import (
    Any,
    Generic,
    Literal,
    NamedTuple,
    Optional,
    Protocol,
    TypeVar,
    Union,
    overload,
)

import jax
import optax

from eqx_offload import checkpoint as checkpoint, errors as errors, memory as memory
from eqx_offload import planner as planner, remat as remat, stream as stream
from eqx_offload import types as types
from eqx_offload.errors import OffloadError as OffloadError
from eqx_offload.memory import memory_report as memory_report
from eqx_offload.planner import plan as plan
from eqx_offload.remat import filter_remat as filter_remat, Policy
from eqx_offload.types import (BackwardUpdate, Compiled, Compute, Donate, Filter, HostMemoryKind,
                               HostWeights, HostWeightsOptimizer, Lowered, MasterWeights,
                               Nested as Nested, Where)

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])

__version__: str
__all__ = [
    "apply_updates",
    "filter_jit",
    "filter_make",
    "filter_remat",
    "filter_shard",
    "host_weights",
    "host_weights_optimizer",
    "install_runtime_checks",
    "jit",
    "master_weights",
    "memory_report",
    "min_bytes",
    "min_ndim",
    "Nested",
    "nnx_jit",
    "offloaded",
    "OffloadedState",
    "OffloadError",
    "pattern",
    "plan",
    "scan_layers",
    "stack_layers",
    "to_device",
    "to_host",
    "update_in_backward",
]

# `where` filters.
@dataclasses.dataclass(frozen=True)
class pattern(Filter):  # noqa: N801 - named like the function it stands for
    regex: str
    def __post_init__(self) -> None: ...

@dataclasses.dataclass(frozen=True)
class min_bytes(Filter):  # noqa: N801
    nbytes: int

@dataclasses.dataclass(frozen=True)
class min_ndim(Filter):  # noqa: N801
    ndim: int

# Moving trees.
def to_host(tree: _T, where: Where = True, *, memory_kind: HostMemoryKind = "pinned_host") -> _T: ...
def to_device(tree: _T, where: Where = True) -> _T: ...
def filter_shard(tree: _T, sharding: jax.sharding.Sharding) -> _T: ...

# Optax.
class OffloadedState(NamedTuple):
    inner_state: Any
    # Reads of the inner state's attributes (`state.hyperparams`, `.count`, ...) and items
    # (`state[0]` is `inner_state[0]`). (`count` and `index`, the inner state's too at
    # run time, are not declared: pytype reads them as fields; see the allowlist.)
    def __getattr__(self, name: str) -> Any: ...
    def __getitem__(self, index: Any) -> Any: ...  # the inner state's items


# What `offloaded` returns is a plain `optax.GradientTransformationExtraArgs` at run time
# (and in the inline annotations that mypy, pyright and pyrefly read). For pytype it is
# this subclass, whose `init` and `update` return an `OffloadedState`: pytype cannot
# narrow `optax.OptState` (`Any`) with `isinstance`, so without it every use of the state
# after `assert isinstance(state, OffloadedState)` would go unchecked. (`update` takes
# what optax's does, an `ArrayTree`: a narrower parameter would break the override.)
class _OffloadedInit(Protocol):
    def __call__(self, params: Any) -> OffloadedState: ...

class _OffloadedUpdate(Protocol):
    def __call__(
        self, updates: Any, state: optax.ArrayTree, params: Any = None, **extra_args: Any
    ) -> tuple[Any, OffloadedState]: ...

class _OffloadedTransformation(optax.GradientTransformationExtraArgs):
    @property
    def init(self) -> _OffloadedInit: ...
    @property
    def update(self) -> _OffloadedUpdate: ...

def offloaded(
    inner: Union[optax.GradientTransformation, optax.MultiSteps],
    where: Where = ...,
    *,
    memory_kind: HostMemoryKind = "pinned_host",
    group_bytes: Union[int, Literal["auto"], None] = "auto",
    lookahead: int = 1,
    compute: Compute = "device",
    host_dtype: Any = None,
    accumulator: Literal["device", "host"] = "device",
) -> _OffloadedTransformation: ...



# jit. What `filter_jit` returns is generic in the function's type (a `TypeVar` bound to
# `Callable`, not a `ParamSpec`): pytype then checks the arguments of each call through
# `__call__`, and `.lower(...)` is there too.
class _FilterJit(Generic[_F]):
    __call__: _F
    def lower(self, *args: Any, **kwargs: Any) -> Lowered: ...
    def export(self, platforms: Optional[Sequence[str]] = None) -> Callable[..., Any]: ...
    def lower_for(
        self, platforms: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Lowered: ...
    def load(self, data: bytes) -> Compiled: ...

@overload
def filter_jit(
    fun: None = None,
    *,
    donate: Union[Donate, tuple[str, ...]] = "none",
    compiler_options: Optional[dict[str, Any]] = None,
) -> Callable[[_F], _FilterJit[_F]]: ...
@overload
def filter_jit(
    fun: _F, *, donate: Union[Donate, tuple[str, ...]] = "none", compiler_options: Optional[dict[str, Any]] = None
) -> _FilterJit[_F]: ...

class _Jit(Generic[_F]):
    __call__: _F
    def lower(self, *args: Any, **kwargs: Any) -> Lowered: ...

@overload
def jit(
    fun: None = None,
    *,
    static_argnums: Union[int, Sequence[int], None] = None,
    static_argnames: Union[str, Iterable[str], None] = None,
    donate_argnums: Union[int, Sequence[int], None] = None,
    donate_argnames: Union[str, Iterable[str], None] = None,
    compiler_options: Optional[dict[str, Any]] = None,
) -> Callable[[_F], _Jit[_F]]: ...
@overload
def jit(
    fun: _F,
    *,
    static_argnums: Union[int, Sequence[int], None] = None,
    static_argnames: Union[str, Iterable[str], None] = None,
    donate_argnums: Union[int, Sequence[int], None] = None,
    donate_argnames: Union[str, Iterable[str], None] = None,
    compiler_options: Optional[dict[str, Any]] = None,
) -> _Jit[_F]: ...

@overload
def nnx_jit(fun: None = None, **jit_kwargs: Any) -> Callable[[_F], _F]: ...
@overload
def nnx_jit(fun: _F, **jit_kwargs: Any) -> _F: ...


# Runtime checks.
def install_runtime_checks(*modules: str) -> None: ...


# Inside models: parameters in host memory.
_M = TypeVar("_M")
_C = TypeVar("_C")

def scan_layers(
    layers: _M,
    x: _C,
    call: Callable[[_M, _C], _C] = ...,
    *,
    policy: Optional[Policy] = None,
    offload_input: bool = False,
    unroll: int = 1,
    prefetch: bool = True,
    accumulate: Optional[Any] = None,
) -> _C: ...

def host_weights(
    module: _M,
    where: Where = True,
    *,
    policy: Optional[Policy] = None,
    memory_kind: HostMemoryKind = "pinned_host",
) -> HostWeights[_M]: ...
def apply_updates(model: _T, updates: Any) -> _T: ...
def host_weights_optimizer(
    inner: optax.GradientTransformation,
    *,
    offload: Optional[
        Callable[[optax.GradientTransformation], optax.GradientTransformation]
    ] = ...,
) -> HostWeightsOptimizer[Any]: ...


def filter_make(fun: Callable[..., _T], *args: Any, group_bytes: int = ...,
                compile_only: bool = ..., **kwargs: Any) -> _T: ...
def stack_layers(make_layer: Callable[[Any], _T], keys: Any) -> _T: ...
def master_weights(
    inner: optax.GradientTransformation,
    *,
    compute_dtype: Any = ...,
    master_dtype: Any = ...,
    offload: Optional[
        Callable[[optax.GradientTransformation], optax.GradientTransformation]
    ] = ...,
) -> MasterWeights[Any]: ...


def update_in_backward(
    optimizer: Union[optax.GradientTransformation, MasterWeights[Any], HostWeightsOptimizer[Any],
                     optax.MultiSteps],
    layers: Callable[[Any], Any],
    *,
    offload: Optional[
        Callable[[optax.GradientTransformation], optax.GradientTransformation]
    ] = ...,
) -> BackwardUpdate[Any]: ...

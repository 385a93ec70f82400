# The public API of eqx_offload, for pytype users: `pytype-single
# --pythonpath=$(python -m eqx_offload typings) ...` reads it, with the stubs of jax,
# equinox, optax and jaxtyping that these signatures refer to. mypy, pyright and pyrefly
# users need none of this: the package ships `py.typed` (mypy users add
# `python -m eqx_offload typings --mypy` to `mypy_path`, for optax).
#
# Kept in step with the code by `mypy.stubtest` (scripts/gates.sh; with `__all__` it
# also fails on a public name missing here).
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import (
    Any,
    BinaryIO,
    ClassVar,
    Generic,
    Literal,
    NamedTuple,
    Optional,
    Protocol,
    TypeVar,
    Union,
    overload,
)

import equinox as eqx
import jax
import optax

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])

__version__: str
__all__ = [
    "abstract_init",
    "apply_updates",
    "CheckpointError",
    "Compiled",
    "CompositionError",
    "DonationError",
    "Compute",
    "deserialise_filter_spec",
    "Donate",
    "Filter",
    "filter_eval_shape",
    "filter_jit",
    "filter_remat",
    "filter_shard",
    "gpu_plan",
    "GPU_TARGETS",
    "GpuPlan",
    "GpuTarget",
    "host_params",
    "host_shardings",
    "host_weights",
    "HostMemoryKind",
    "HostParams",
    "HostWeights",
    "install_runtime_checks",
    "jit",
    "LAYER_INPUT",
    "LeafMemory",
    "Lowered",
    "master_weights",
    "MasterState",
    "MasterWeights",
    "memory_report",
    "MemoryKind",
    "MemoryKindError",
    "MemoryReport",
    "min_bytes",
    "min_ndim",
    "Nested",
    "nnx_jit",
    "NotATransformationError",
    "offload_dots",
    "offload_names",
    "offload_regex",
    "offloaded",
    "OffloadedState",
    "OffloadError",
    "OffloadWarning",
    "OptionError",
    "pattern",
    "plan",
    "PlanError",
    "PlannedCollective",
    "PlannedCopy",
    "Policy",
    "prefetch_options",
    "restore_target",
    "scan_layers",
    "SignatureError",
    "StateError",
    "stream_plan",
    "StreamPlan",
    "supported_memory_kinds",
    "to_device",
    "to_host",
    "tree_deserialise_leaves",
    "TracedMoveError",
    "TreeError",
    "Where",
    "WhereError",
    "with_host_params",
    "within_budget",
]

# Types.
Nested = Union[_T, Mapping[Any, "Nested[_T]"], list["Nested[_T]"], tuple["Nested[_T]", ...]]
MemoryKind = Literal["device", "pinned_host", "unpinned_host"]
HostMemoryKind = Literal["pinned_host", "unpinned_host"]
Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]
Where = Nested[Union[bool, Callable[[Any], bool], eqx.Module, None]]
Compute = Literal["device", "host"]

# Errors.
class OffloadError(Exception): ...
class OptionError(OffloadError, ValueError, TypeError): ...
class MemoryKindError(OffloadError, ValueError): ...
class WhereError(OffloadError, ValueError): ...
class TreeError(OffloadError, TypeError): ...
class SignatureError(OffloadError, TypeError): ...
class TracedMoveError(OffloadError, ValueError): ...
class StateError(OffloadError, TypeError): ...
class NotATransformationError(OffloadError, TypeError): ...
class DonationError(OffloadError, RuntimeError): ...
class PlanError(OffloadError, RuntimeError): ...
class CompositionError(OffloadError, ValueError): ...
class CheckpointError(OffloadError, ValueError): ...

# `where` filters.
class Filter:
    def __call__(self, leaf: Any, path: str = "") -> bool: ...
    def __and__(self, other: Callable[[Any], bool]) -> Filter: ...
    def __rand__(self, other: Callable[[Any], bool]) -> Filter: ...
    def __or__(self, other: Callable[[Any], bool]) -> Filter: ...
    def __ror__(self, other: Callable[[Any], bool]) -> Filter: ...
    def __invert__(self) -> Filter: ...

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
def supported_memory_kinds(device: Optional[jax.Device] = None) -> tuple[str, ...]: ...

# Optax.
class OffloadedState(NamedTuple):
    inner_state: Any
    # Reads of the inner state's attributes (`state.hyperparams`, `.count`, ...) and items
    # (`state[0]` is `inner_state[0]`). (`count` and `index`, the inner state's too at
    # run time, are not declared: pytype reads them as fields; see the allowlist.)
    def __getattr__(self, name: str) -> Any: ...
    def __getitem__(self, index: Any) -> Any: ...  # the inner state's items

class OffloadWarning(UserWarning): ...

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

# Budgets.
def within_budget(
    inner: optax.GradientTransformation, params: Any, device_bytes: int
) -> Any: ...  # a pytree of bools shaped like `inner.init(params)`: a `where`
def prefetch_options(
    device_bytes: Optional[int] = None, *, device_memory_size: Optional[int] = None
) -> dict[str, Any]: ...

# The planner (its names live in `eqx_offload.planner`).
from eqx_offload.planner import (
    GPU_TARGETS as GPU_TARGETS,
    GpuTarget as GpuTarget,
    Plan,
    plan as plan,
    PlannedCollective as PlannedCollective,
    PlannedCopy as PlannedCopy,
    TpuTarget,
)

GpuPlan = Plan

def gpu_plan(
    fun: Callable[..., Any],
    *args: Any,
    target: Union[str, GpuTarget, TpuTarget] = "h200",
    device_memory: Optional[int] = None,
    compiler_options: Optional[dict[str, Any]] = None,
    host_memory: Optional[int] = None,
    **kwargs: Any,
) -> Plan: ...

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

# jit. What `filter_jit` returns is generic in the function's type (a `TypeVar` bound to
# `Callable`, not a `ParamSpec`): pytype then checks the arguments of each call through
# `__call__`, and `.lower(...)` is there too.
class Compiled:
    def __init__(self, executable: Any, output: Any, key: Any, donate: str, name: str) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def memory_analysis(self) -> Any: ...
    def cost_analysis(self) -> Any: ...
    def as_text(self) -> Optional[str]: ...

class Lowered:
    jaxpr: Any
    compiler_options: dict[str, Any]
    def __init__(self, lowered: Any, output: Any, key: Any, donate: str, name: str,
                 compiler_options: dict[str, Any], jaxpr: Any) -> None: ...
    def compile(self, compiler_options: Optional[dict[str, Any]] = None) -> Compiled: ...
    def as_text(self) -> str: ...
    def compiler_ir(self, dialect: str = "stablehlo") -> Any: ...

class _FilterJit(Generic[_F]):
    __call__: _F
    def lower(self, *args: Any, **kwargs: Any) -> Lowered: ...
    def export(self, platforms: Optional[Sequence[str]] = None) -> Callable[..., Any]: ...
    def lower_for(
        self, platforms: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Lowered: ...

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

# Reports.
@dataclasses.dataclass(frozen=True)
class LeafMemory:
    path: str
    memory_kind: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str

@dataclasses.dataclass(frozen=True)
class MemoryReport:
    by_kind: dict[str, int]
    leaves: tuple[LeafMemory, ...]
    host_pool_bytes: int = 0
    host_pool_limit: Optional[int] = None
    @property
    def device_bytes(self) -> int: ...
    @property
    def host_bytes(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    def __rich__(self) -> Any: ...

def memory_report(tree: Any) -> MemoryReport: ...

# Runtime checks.
def install_runtime_checks(*modules: str) -> None: ...

# Checkpoints.
def host_shardings(
    tree: Any, where: Where = True, *, memory_kind: HostMemoryKind = "pinned_host"
) -> Any: ...
def restore_target(
    tree: _T, where: Where = False, *, memory_kind: HostMemoryKind = "pinned_host"
) -> _T: ...
def abstract_init(optimizer: optax.GradientTransformation, params: Any) -> Any: ...
def deserialise_filter_spec(f: BinaryIO, x: Any) -> Any: ...
def tree_deserialise_leaves(
    path_or_file: Any,
    like: _T,
    filter_spec: Callable[[BinaryIO, Any], Any] = ...,
    is_leaf: Optional[Callable[[Any], bool]] = None,
) -> _T: ...
def filter_eval_shape(fun: Callable[..., _T], *args: Any, **kwargs: Any) -> _T: ...

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

class HostWeights(eqx.Module, Generic[_M]):
    module: _M
    policy: Optional[Policy] = None
    # Set by Equinox's metaclass on every Module subclass (class variables, not fields).
    __abstractvars__: ClassVar[frozenset[str]]
    __abstractclassvars__: ClassVar[frozenset[str]]
    def __init__(self, module: _M, policy: Optional[Policy] = None) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

def host_weights(
    module: _M,
    where: Where = True,
    *,
    policy: Optional[Policy] = None,
    memory_kind: HostMemoryKind = "pinned_host",
) -> HostWeights[_M]: ...
def apply_updates(model: _T, updates: Any) -> _T: ...
def with_host_params(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs: ...
@dataclasses.dataclass(frozen=True)
class HostParams(Generic[_M]):
    transformation: optax.GradientTransformationExtraArgs
    def init(self, model: Any) -> Any: ...
    def update(self, grads: Any, state: Any, model: _M, **extra_args: Any) -> tuple[_M, Any]: ...

def host_params(
    inner: optax.GradientTransformation,
    *,
    offload: Optional[
        Callable[[optax.GradientTransformation], optax.GradientTransformation]
    ] = ...,
) -> HostParams[Any]: ...

# Activations in host memory.
Policy = Callable[..., Any]
LAYER_INPUT: str

def offload_names(*names: str, save: tuple[str, ...] = ()) -> Policy: ...
def offload_regex(offload: Optional[str], *, save: Optional[str] = None) -> Policy: ...
def offload_dots() -> Policy: ...
def filter_remat(fun: _F, policy: Optional[Policy] = None, *, prevent_cse: bool = True) -> _F: ...

# Master weights.
class MasterState(NamedTuple):
    master: Any
    inner_state: Any

@dataclasses.dataclass(frozen=True)
class MasterWeights(Generic[_M]):
    transformation: optax.GradientTransformationExtraArgs
    compute_dtype: Any
    def init(self, model: _M) -> tuple[_M, Any]: ...
    def update(self, grads: Any, state: Any, model: _M, **extra_args: Any) -> tuple[_M, Any]: ...

def master_weights(
    inner: optax.GradientTransformation,
    *,
    compute_dtype: Any = ...,
    master_dtype: Any = ...,
    offload: Optional[
        Callable[[optax.GradientTransformation], optax.GradientTransformation]
    ] = ...,
) -> MasterWeights[Any]: ...

# Stubs for optax 0.2.x, which ships no `py.typed`: read by pytype
# (`--pythonpath=$(python -m eqx_offload typings)`) and by mypy (`mypy_path`). The core types follow
# `optax/_src/base.py`; the optimizers, combinators, schedules and losses that training
# scripts use are declared precisely, every other name is `Any` (`__getattr__` below).
#
# Two deliberate differences from optax's own annotations:
#
# - `Params` and `Updates` are `Any`, since a parameter pytree may be any pytree (an
#   `equinox.Module` is neither an `Iterable` nor a `Mapping`, so optax's `ArrayTree`
#   would reject every Equinox model).
# - `OptState`, the state a user holds (what `init` and `update` return), is `Any`; where
#   a transformation *takes* a state, the parameter keeps optax's recursive `ArrayTree`,
#   so passing a transformation (a NamedTuple of functions) as a state is still an
#   error. Why: pytype evaluates `isinstance(x, C)` on instances of x's declared types,
#   so narrowing a value declared as `ArrayTree` (a union of `ArrayLike`, `Iterable` and
#   `Mapping`, none of them a subclass of `C`) to an optax or eqx_offload state class is
#   "always false" to it, and it silently skips every line after
#   `assert isinstance(state, eqx_offload.OffloadedState)`. `Any` is the one declared
#   type that pytype narrows as "may be `C`". (mypy, pyright and pyrefly narrow either
#   way; mypy loses nothing it checked: a union of `Iterable` and `Mapping` accepted
#   almost any value.)
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, Optional, Protocol, Self, Union

import numpy as _np

import jax
from jax.typing import ArrayLike, DTypeLike

PyTree = Any
Shape = Sequence[int]
PRNGKey = jax.Array
ArrayTree = Union[ArrayLike, Iterable["ArrayTree"], Mapping[Any, "ArrayTree"]]
OptState = Any  # see above: optax says `ArrayTree`
Params = Any
Updates = Any
Schedule = Callable[[ArrayLike], ArrayLike]
ScheduleState = Any
ScalarOrSchedule = Union[float, jax.Array, Schedule]
MaskOrFn = Union[Any, Callable[[Params], Any]]

class TransformInitFn(Protocol):
    def __call__(self, params: Params) -> OptState: ...

class TransformUpdateFn(Protocol):
    def __call__(
        self, updates: Updates, state: ArrayTree, params: Optional[Params] = None
    ) -> tuple[Updates, OptState]: ...

class TransformUpdateExtraArgsFn(Protocol):
    def __call__(
        self,
        updates: Updates,
        state: ArrayTree,
        params: Optional[Params] = None,
        **extra_args: Any,
    ) -> tuple[Updates, OptState]: ...

class GradientTransformation(tuple[TransformInitFn, TransformUpdateFn]):
    # A NamedTuple at run time. Declared as a tuple subclass so that construction accepts
    # any `init`/`update` callables (an `update` that only accepts its own state type is
    # the norm), while the fields `.init` and `.update` keep optax's precise types.
    _fields: ClassVar[tuple[str, ...]]
    def __new__(
        cls, init: Callable[[Params], Any], update: Callable[..., tuple[Updates, Any]]
    ) -> Self: ...
    def __init__(
        self, init: Callable[[Params], Any], update: Callable[..., tuple[Updates, Any]]
    ) -> None: ...
    @property
    def init(self) -> TransformInitFn: ...
    @property
    def update(self) -> TransformUpdateFn: ...
    def _replace(self, **kwargs: Any) -> Self: ...
    def _asdict(self) -> dict[str, Any]: ...

class GradientTransformationExtraArgs(GradientTransformation):
    @property
    def update(self) -> TransformUpdateExtraArgsFn: ...

# States (NamedTuples) of the transformations declared below.
class EmptyState(NamedTuple): ...

class ScaleByAdamState(NamedTuple):
    count: ArrayLike  # type: ignore[assignment]  # optax names the field `count`, shadowing tuple.count
    mu: Updates
    nu: Updates

class ScaleByLionState(NamedTuple):
    count: ArrayLike  # type: ignore[assignment]  # optax names the field `count`, shadowing tuple.count
    mu: Updates

class ScaleByRmsState(NamedTuple):
    nu: Updates

class ScaleByScheduleState(NamedTuple):
    count: ArrayLike  # type: ignore[assignment]  # optax names the field `count`, shadowing tuple.count

class TraceState(NamedTuple):
    trace: Params

class ClipByGlobalNormState(NamedTuple): ...
class AddDecayedWeightsState(NamedTuple): ...
class ScaleState(NamedTuple): ...

class MaskedState(NamedTuple):
    inner_state: Any

class MaskedNode(NamedTuple): ...

class MultiTransformState(NamedTuple):
    inner_states: Mapping[Hashable, OptState]

class InjectHyperparamsState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]  # optax names the field `count`, shadowing tuple.count
    hyperparams: dict[str, ArrayLike]
    inner_state: OptState

class ApplyIfFiniteState(NamedTuple):
    notfinite_count: Any
    last_finite: Any
    total_notfinite: Any
    inner_state: Any

class MultiStepsState(NamedTuple):
    mini_step: ArrayLike
    gradient_step: ArrayLike
    inner_opt_state: Any
    acc_grads: Any
    skip_state: ArrayTree = ...  # `()` at run time

# Optimizers.
def adam(
    learning_rate: ScalarOrSchedule,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-08,
    eps_root: ArrayLike = 0.0,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs: ...
def adamw(
    learning_rate: ScalarOrSchedule,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-08,
    eps_root: ArrayLike = 0.0,
    mu_dtype: Optional[Any] = None,
    weight_decay: ScalarOrSchedule = 0.0001,
    mask: Optional[MaskOrFn] = None,
    *,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs: ...
def nadam(
    learning_rate: ScalarOrSchedule,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-08,
    eps_root: ArrayLike = 0.0,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = True,
) -> GradientTransformationExtraArgs: ...
def lion(
    learning_rate: ScalarOrSchedule,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.99,
    mu_dtype: Optional[Any] = None,
    weight_decay: ScalarOrSchedule = 0.001,
    mask: Optional[MaskOrFn] = None,
) -> GradientTransformationExtraArgs: ...
def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: Optional[ArrayLike] = None,
    nesterov: bool = False,
    accumulator_dtype: Optional[Any] = None,
) -> GradientTransformationExtraArgs: ...
def rmsprop(
    learning_rate: ScalarOrSchedule,
    decay: ArrayLike = 0.9,
    eps: ArrayLike = 1e-08,
    initial_scale: ArrayLike = 0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum: Optional[ArrayLike] = None,
    nesterov: bool = False,
    bias_correction: bool = False,
) -> GradientTransformationExtraArgs: ...
def adagrad(
    learning_rate: ScalarOrSchedule,
    initial_accumulator_value: ArrayLike = 0.1,
    eps: ArrayLike = 1e-07,
) -> GradientTransformationExtraArgs: ...
def adafactor(
    learning_rate: Optional[ScalarOrSchedule] = None,
    min_dim_size_to_factor: int = 128,
    decay_rate: ArrayLike = 0.8,
    decay_offset: ArrayLike = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: Optional[ArrayLike] = 1.0,
    momentum: Optional[ArrayLike] = None,
    dtype_momentum: DTypeLike = ...,
    weight_decay_rate: Optional[ScalarOrSchedule] = None,
    eps: ArrayLike = 1e-30,
    factored: bool = True,
    weight_decay_mask: Optional[MaskOrFn] = None,
) -> GradientTransformationExtraArgs: ...
def lamb(
    learning_rate: ScalarOrSchedule,
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-06,
    eps_root: ArrayLike = 0.0,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: Optional[MaskOrFn] = None,
) -> GradientTransformationExtraArgs: ...

# Transformations and combinators.
def identity() -> GradientTransformation: ...
def set_to_zero() -> GradientTransformation: ...
def stateless(f: Callable[[Updates, Optional[Params]], Updates]) -> GradientTransformation: ...
def with_extra_args_support(tx: GradientTransformation) -> GradientTransformationExtraArgs: ...
def chain(*args: GradientTransformation) -> GradientTransformationExtraArgs: ...
def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformationExtraArgs: ...
def clip(max_delta: ArrayLike) -> GradientTransformation: ...
def clip_by_global_norm(max_norm: ArrayLike) -> GradientTransformation: ...
def scale(step_size: ArrayLike) -> GradientTransformation: ...
def scale_by_learning_rate(
    learning_rate: Optional[ScalarOrSchedule] = None, *, flip_sign: bool = True
) -> GradientTransformation: ...
def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation: ...
def scale_by_adam(
    b1: ArrayLike = 0.9,
    b2: ArrayLike = 0.999,
    eps: ArrayLike = 1e-08,
    eps_root: ArrayLike = 0.0,
    mu_dtype: Optional[DTypeLike] = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation: ...
def scale_by_rms(
    decay: ArrayLike = 0.9,
    eps: ArrayLike = 1e-08,
    initial_scale: ArrayLike = 0.0,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformation: ...
def add_decayed_weights(
    weight_decay: ScalarOrSchedule = 0.0, mask: Optional[MaskOrFn] = None
) -> GradientTransformation: ...
def trace(
    decay: ArrayLike, nesterov: bool = False, accumulator_dtype: Optional[Any] = None
) -> GradientTransformation: ...
def ema(
    decay: ArrayLike, debias: bool = True, accumulator_dtype: Optional[Any] = None
) -> GradientTransformation: ...
def zero_nans() -> GradientTransformation: ...
def masked(
    inner: GradientTransformation, mask: MaskOrFn, *, mask_compatible_extra_args: bool = False
) -> GradientTransformationExtraArgs: ...
def multi_transform(
    transforms: Mapping[Hashable, GradientTransformation],
    param_labels: Union[Any, Callable[[Any], Any]],
    *,
    mask_compatible_extra_args: bool = False,
) -> GradientTransformationExtraArgs: ...
def partition(
    transforms: Mapping[Hashable, GradientTransformation],
    param_labels: Union[Any, Callable[[Any], Any]],
    *,
    mask_compatible_extra_args: bool = False,
) -> GradientTransformationExtraArgs: ...
def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: Union[str, Iterable[str]] = (),
    hyperparam_dtype: Optional[_np.dtype[Any]] = None,
) -> Callable[..., GradientTransformationExtraArgs]: ...
def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int
) -> GradientTransformation: ...

class MultiSteps:
    def __init__(
        self,
        opt: GradientTransformation,
        every_k_schedule: Union[int, Callable[[ArrayLike], ArrayLike]],
        use_grad_mean: bool = True,
        should_skip_update_fn: Optional[Callable[..., Any]] = None,
        accumulator_dtype: DTypeLike = ...,
    ) -> None: ...
    @property
    def inner_opt(self) -> GradientTransformationExtraArgs: ...
    def init(self, params: Params) -> MultiStepsState: ...
    def update(
        self,
        updates: Updates,
        state: MultiStepsState,
        params: Optional[Params] = None,
        **extra_args: Any,
    ) -> tuple[Updates, MultiStepsState]: ...
    def has_updated(self, state: Union[MultiStepsState, ArrayTree]) -> jax.Array: ...
    def gradient_transformation(self) -> GradientTransformationExtraArgs: ...

# Applying updates.
def apply_updates(params: Params, updates: Updates) -> Params: ...
def incremental_update(new_tensors: Params, old_tensors: Params, step_size: ArrayLike) -> Params: ...
def global_norm(updates: Updates) -> jax.Array: ...

# Schedules.
def constant_schedule(value: ArrayLike) -> Schedule: ...
def linear_schedule(
    init_value: ArrayLike, end_value: ArrayLike, transition_steps: int, transition_begin: int = 0
) -> Schedule: ...
def cosine_decay_schedule(
    init_value: ArrayLike, decay_steps: int, alpha: ArrayLike = 0.0, exponent: ArrayLike = 1.0
) -> Schedule: ...
def warmup_cosine_decay_schedule(
    init_value: ArrayLike,
    peak_value: ArrayLike,
    warmup_steps: int,
    decay_steps: int,
    end_value: ArrayLike = 0.0,
    exponent: ArrayLike = 1.0,
) -> Schedule: ...
def exponential_decay(
    init_value: ArrayLike,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: Optional[ArrayLike] = None,
) -> Schedule: ...
def piecewise_constant_schedule(
    init_value: ArrayLike, boundaries_and_scales: Optional[dict[int, float]] = None
) -> Schedule: ...
def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule: ...

# Losses.
def l2_loss(predictions: ArrayLike, targets: Optional[ArrayLike] = None) -> jax.Array: ...
def squared_error(predictions: ArrayLike, targets: Optional[ArrayLike] = None) -> jax.Array: ...
def softmax_cross_entropy(
    logits: ArrayLike,
    labels: ArrayLike,
    axis: Union[int, tuple[int, ...], None] = -1,
    where: Optional[ArrayLike] = None,
) -> jax.Array: ...
def softmax_cross_entropy_with_integer_labels(
    logits: ArrayLike,
    labels: ArrayLike,
    axis: Union[int, tuple[int, ...]] = -1,
    where: Optional[ArrayLike] = None,
) -> jax.Array: ...
def sigmoid_binary_cross_entropy(logits: ArrayLike, labels: ArrayLike) -> jax.Array: ...
def __getattr__(name: str) -> Any: ...

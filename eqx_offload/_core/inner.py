"""One normalisation of an `inner` optimizer, for every function that takes one
(`offloaded`, `within_budget`, `stream_plan`, `abstract_init`): the same clear error for
an optimizer factory or a model, wherever it is passed."""

from typing import Any

import optax

from .errors import not_a_transformation_error


def as_transformation(inner: Any, call: str = "offloaded(inner=...)") -> optax.GradientTransformationExtraArgs:
    """`inner` as a `GradientTransformationExtraArgs`, or a `NotATransformationError`
    that names `call` (e.g. `"within_budget(inner=...)"`) and the fix."""
    if isinstance(inner, optax.GradientTransformationExtraArgs):
        return inner
    if isinstance(inner, optax.GradientTransformation):
        return optax.with_extra_args_support(inner)
    if callable(getattr(inner, "gradient_transformation", None)):
        # `optax.MultiSteps`, which is not itself a GradientTransformation. Its
        # `gradient_transformation()` is a plain `GradientTransformation`, whose extra
        # arguments `with_extra_args_support` would drop; its `update` takes them.
        return optax.GradientTransformationExtraArgs(inner.init, inner.update)
    raise not_a_transformation_error(call, inner)

"""fp32 master weights in host memory, bf16 compute weights on the device.

`master_weights(inner)` keeps, for every floating parameter, an fp32 master copy next to
`inner`'s state, and both in host memory (through `offloaded`, so the update can be
streamed like any offloaded state). The model the step differentiates holds the
parameters in the compute dtype. One update: the gradients (compute dtype) are widened
to fp32, `inner` updates the fp32 master weights on the device, and the new compute
weights are the new master weights rounded to the compute dtype -- exactly, since they
are computed from them and nothing else.
"""

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, cast, Generic, NamedTuple, Optional, TypeVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import optax

from .._core.errors import docs_link, OffloadWarning, OptionError, StateError
from .._core.inner import as_transformation
from .._core.leaves import is_none, is_traced
from .._core.move import place_like
from .._optim.offloaded import offloaded
from .make import filter_make
from .params import fetch_each


_M = TypeVar("_M")


class MasterState(NamedTuple):
    """The state of `master_weights` (inside the `OffloadedState` when offloaded).

    **Fields:**

    - `master`: the master copy of the parameters: each floating array leaf in the
        master dtype, `None` elsewhere.
    - `inner_state`: the state of the wrapped transformation (of the master weights).
    """

    master: Any
    inner_state: Any


def _is_float(x: Any) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


def _cast_leaf(dtype: Any, x: Any) -> Any:
    return x.astype(dtype) if _is_float(x) else x


def _master_leaf(dtype: Any, x: Any) -> Any:
    return x.astype(dtype) if _is_float(x) else None


def _widen(grad: Any, master: Any) -> Any:
    return None if master is None else grad.astype(master.dtype)


def _round(param: Any, master: Any) -> Any:
    return param if master is None else master.astype(param.dtype)


def _cast(tree: Any, dtype: Any) -> Any:
    return jtu.tree_map(functools.partial(_cast_leaf, dtype), tree)


def _compute_like(params: Any, dtype: Any) -> Any:
    return place_like(_cast(fetch_each(params), dtype), params)


def _masters(params: Any, dtype: Any) -> Any:
    return jtu.tree_map(functools.partial(_master_leaf, dtype), params)


def _master_transformation(
    inner: optax.GradientTransformationExtraArgs, master_dtype: Any
) -> optax.GradientTransformationExtraArgs:
    """The update on the master weights, as an optax transformation whose "updates"
    are the new compute parameters (private: `MasterWeights.update` unpacks them)."""

    def init_fn(params: optax.Params) -> MasterState:
        master = _masters(fetch_each(params), master_dtype)
        return MasterState(master, inner.init(master))

    def update_fn(
        updates: optax.Updates, state: optax.OptState, params: Optional[optax.Params] = None,
        **extra_args: Any,
    ) -> tuple[Any, optax.OptState]:
        # `updates` are the gradients; the "updates" returned are the new parameters.
        if not isinstance(state, MasterState):
            raise StateError(f"master_weights: update got a {type(state).__name__} state; "
                             "pass the state that `init` (or the previous `update`) returned.")
        if params is None:
            raise OptionError("master_weights: update needs the compute parameters "
                              "(`params`), to know their dtypes.")
        master = state.master
        # Gradients of weights kept in host memory come to the device first.
        wide = jtu.tree_map(_widen, fetch_each(updates), master, is_leaf=is_none)
        steps, inner_state = inner.update(wide, state.inner_state, master, **extra_args)
        new_master = optax.apply_updates(master, steps)
        new_params = jtu.tree_map(_round, params, new_master, is_leaf=is_none)
        return new_params, MasterState(new_master, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class MasterWeights(Generic[_M]):
    """What `master_weights` returns: `init` and `update` for a model trained with
    master weights. (Not an `optax.GradientTransformation`: its update returns the new
    model, not updates to add, because a compute-dtype sum `p + u` could not be the
    exact rounding of the new master weights.)"""

    transformation: optax.GradientTransformationExtraArgs
    compute_dtype: Any

    def init(self, model: _M) -> tuple[_M, Any]:
        """From a model in full precision: the model in the compute dtype (floating
        array leaves cast, on the device) and the state (the master weights, in the
        master dtype, and the inner state; in host memory when offloaded).

        **Arguments:**

        - `model`: the model (an `eqx.Module` or any pytree), its floating leaves in
            the master dtype or narrower. Leaves in host memory stay there (cast on
            the device).

        **Returns:**

        `(compute_model, state)`.
        """
        params = eqx.filter(model, eqx.is_array)
        state = self.transformation.init(params)
        # Cast on the device; a leaf in host memory goes back there in the compute dtype.
        # Eagerly, `filter_make`'s programs cast a group of leaves at a time, written
        # straight into their memory (never the whole model on the device at once).
        cast_like = functools.partial(_compute_like, dtype=self.compute_dtype)
        compute = (cast_like(params) if any(map(is_traced, jtu.tree_leaves(params)))
                   else filter_make(cast_like, params))
        return eqx.combine(compute, eqx.filter(model, eqx.is_array, inverse=True)), state

    def update(self, grads: Any, state: Any, model: _M, **extra_args: Any) -> tuple[_M, Any]:
        """One optimizer step: the gradients of the compute model widened to the master
        dtype, the inner transformation's update of the master weights, and the new
        compute model, each floating leaf the new master weight rounded to its dtype
        and kept in the memory kind of the old one (compute weights in host memory,
        `host_weights` or `scan_layers` style, stay there; their gradients may be
        there too).

        **Arguments:**

        - `grads`: gradients with respect to the compute model (e.g.
            `eqx.filter_grad(loss)(model, ...)`).
        - `state`: the state `init` or the previous `update` returned.
        - `model`: the compute model the gradients belong to.
        - `**extra_args`: passed to the inner transformation.

        **Returns:**

        `(new_model, new_state)`.
        """
        params, static = eqx.partition(model, eqx.is_array)
        new_params, state = self.transformation.update(grads, state, params, **extra_args)
        new_model = cast(_M, eqx.combine(place_like(new_params, params), static))
        return new_model, state


def master_weights(
    inner: optax.GradientTransformation,
    *,
    compute_dtype: Any = jnp.bfloat16,
    master_dtype: Any = jnp.float32,
    offload: Optional[Callable[[optax.GradientTransformation],
                               optax.GradientTransformation]] = offloaded,
) -> MasterWeights[Any]:
    """Trains a model in `compute_dtype` (bf16) with `master_dtype` (fp32) master weights,
    which live with the optimizer state in host memory.

    The model the step differentiates holds its floating parameters in
    `compute_dtype`, on the device; the fp32 master weights and `inner`'s state are kept
    by `offload` (default `eqx_offload.offloaded`: in host memory, fetched to the device
    for the update). The update runs in the master dtype on the device; the new compute
    weights are exactly the new master weights rounded to `compute_dtype`.

    **Arguments:**

    - `inner`: the optimizer of the master weights, e.g. `optax.adamw(1e-3)`.
    - `compute_dtype`: the dtype of the model's floating leaves (default `bfloat16`).
    - `master_dtype`: the dtype of the master weights (default `float32`), in host
        memory and in the update. The only way to narrow them: `offloaded`'s
        `host_dtype` narrows `inner`'s state (the moments), never the master weights.
        A master no wider than `compute_dtype` warns (`OffloadWarning`).
    - `offload`: how the master weights and `inner`'s state are kept: a function from a
        transformation to one, default `eqx_offload.offloaded`; e.g.
        `functools.partial(eqx_offload.offloaded, group_bytes=64 << 20)` to stream the
        update, `functools.partial(eqx_offload.offloaded, host_dtype=jnp.int8)` for
        8-bit moments beside fp32 master weights, or `None` to keep them on the device.

    **Returns:**

    A `MasterWeights` with `init(model) -> (compute_model, state)` and
    `update(grads, state, model) -> (new_model, new_state)`.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import optax
        import eqx_offload

        mw = eqx_offload.master_weights(optax.adamw(1e-2))
        model, state = mw.init(eqx.nn.Linear(4, 4, key=jax.random.key(0)))
        assert model.weight.dtype == jnp.bfloat16

        @eqx_offload.filter_jit(donate="all")
        def step(model, state, x):
            grads = eqx.filter_grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(model)
            return mw.update(grads, state, model)

        model, state = step(model, state, jnp.ones(4, jnp.bfloat16))
        master = state.inner_state.master.weight
        assert master.sharding.memory_kind == "pinned_host"
        ```
    """
    for argument, dtype in (("compute_dtype", compute_dtype), ("master_dtype", master_dtype)):
        try:
            floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise OptionError(f"master_weights({argument}={dtype!r}): pass a floating "
                              "dtype, e.g. jnp.bfloat16 or jnp.float32.")
    if jnp.dtype(master_dtype).itemsize <= jnp.dtype(compute_dtype).itemsize:
        warnings.warn(
            "Pass master_dtype=jnp.float32 (the default) for master weights wider than "
            "the compute weights, or train the model without master_weights.\n"
            f"master_weights(master_dtype={jnp.dtype(master_dtype).name}, compute_dtype="
            f"{jnp.dtype(compute_dtype).name}): the master weights are no wider than the "
            "weights, so they cost memory and add no precision.\n"
            f"See {docs_link('models.md', 'fp32-master-weights-in-host-memory')}.",
            OffloadWarning, stacklevel=2)
    if offload is not None and not callable(offload):
        raise OptionError(f"master_weights(offload={offload!r}): pass a function from a "
                          "transformation to a transformation (e.g. eqx_offload.offloaded), "
                          "or None.")
    transformation = _master_transformation(
        as_transformation(inner, "master_weights(inner=...)"), jnp.dtype(master_dtype))
    if offload is not None:
        transformation = optax.with_extra_args_support(offload(transformation))
    return MasterWeights(transformation, jnp.dtype(compute_dtype))

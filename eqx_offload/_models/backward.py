"""`update_in_backward`: the optimizer step of a `scan_layers` model's stacked layers run
inside the backward pass, one layer at a time, as the backward scan makes each layer's
gradient; the other parameters are updated after it.

The step differentiates the loss with respect to the parameters and to the stacked
layers' per-layer optimizer state, with `scan_layers` hooked (`_stream.backward`): its
custom VJP returns the new layers and state in place of their cotangents, so what the
gradient hands back for them is the updated model and state. The optimizer's state is
split in two halves (`_optim.backward`), each updated by the optimizer as a black box.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Generic, Optional, TYPE_CHECKING, TypeVar, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jax.extend.core import jaxpr_as_fun, Literal
from jax.experimental.layout import Layout, with_layout_constraint  # pytype: disable=import-error  # (no stub of it)

from .._core.errors import (
    CompositionError, not_a_transformation_error, OptionError, StateError,
)
from .._core.inner import as_transformation
from .._core.move import send_to_host
from .._core.placement import any_on_host, is_host
from .._optim.quantize import CODE_DTYPE
from .._optim.backward import (
    BackwardState, check_not_accumulating, check_separable, DOCS, halves, per_layer,
)
from .._optim.offloaded import for_layers, made_of
from .._stream import Hook, hooked
from .master import MasterWeights
from .params import apply_updates, HostWeightsOptimizer


if TYPE_CHECKING:  # (a default for the checkers: a step not annotated is of `Any` model)
    from typing_extensions import TypeVar as _DefaultTypeVar
    _M = _DefaultTypeVar("_M", default=Any)  # pytype: disable=invalid-typevar  # (no defaults)
else:
    _M = TypeVar("_M")
Optimizer = Union[optax.GradientTransformation, MasterWeights[Any], HostWeightsOptimizer[Any],
                  optax.MultiSteps]
"""What `update_in_backward` takes: an optax transformation, or what `master_weights` or
`host_weights_optimizer` returns (an `optax.MultiSteps` only to be refused, naming the
route)."""
Offload = Callable[[optax.GradientTransformation], optax.GradientTransformation]
"""How `update_in_backward` keeps the optimizer's state, e.g. `eqx_offload.offloaded`."""


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one model structure needs, found once: which parameter leaves are the
    stacked layers' (`in_layers`), which leaves of the layers' state are stacked per
    layer (`stacked`), the structures to rebuild trees with, and the optimizer of the
    stacked layers (`layer_optimizer`, its transformation `transformation`)."""

    treedef: Any  # of the parameters (`eqx.filter(model, eqx.is_array)`)
    in_layers: tuple[bool, ...]
    state_def: Any  # of the layers' half of the state
    stacked: tuple[bool, ...]
    layers: int  # the number of stacked layers
    layer_optimizer: Any  # as the optimizer given: a transformation, `MasterWeights`, ...
    transformation: optax.GradientTransformationExtraArgs  # `layer_optimizer`'s


def _transformation(optimizer: Any) -> optax.GradientTransformationExtraArgs:
    if isinstance(optimizer, (MasterWeights, HostWeightsOptimizer)):
        return optimizer.transformation
    return optax.with_extra_args_support(optimizer)


def _with_transformation(optimizer: Any, transformation: Any) -> Any:
    """`optimizer` (normalised) with `transformation` in place of its own."""
    if isinstance(optimizer, (MasterWeights, HostWeightsOptimizer)):
        return dataclasses.replace(optimizer, transformation=transformation)
    return transformation


def _normalised(optimizer: Any, offload: Optional[Offload]) -> Any:
    """`optimizer` with its transformation a `GradientTransformationExtraArgs`, kept by
    `offload` where given; or the error that names the fix."""
    if isinstance(optimizer, optax.MultiSteps):
        check_not_accumulating(optax.MultiStepsState(0, 0, None, None))
    if not isinstance(optimizer, (MasterWeights, HostWeightsOptimizer)):
        optimizer = as_transformation(optimizer, "update_in_backward(optimizer=...)")
    transformation = _transformation(optimizer)
    if offload is None:
        return optimizer
    if made_of(transformation) is not None:
        raise OptionError("update_in_backward(optimizer=..., offload=...): pass the "
                          "optimizer unwrapped, e.g. `update_in_backward(optax.adamw(...), "
                          "layers=..., offload=eqx_offload.offloaded)`; it is offloaded "
                          f"already.\nSee {DOCS}.")
    return _with_transformation(
        optimizer, optax.with_extra_args_support(offload(transformation)))


def _for_layers(optimizer: Any, layers: int) -> Any:
    """The optimizer of `layers` stacked layers updated one at a time inside the
    backward pass: an `offloaded` transformation remade with its options for them
    (`offloaded.for_layers`); any other as it is."""
    made = made_of(_transformation(optimizer))
    if made is None:
        return optimizer
    return _with_transformation(optimizer, for_layers(made, layers))


class BackwardUpdate(Generic[_M]):  # pytype: disable=invalid-annotation  # (_M above)
    """What `update_in_backward` returns: `init(model) -> (model, state)` and
    `step(loss, model, state, *args) -> (loss value, model, state)`.

    **Fields:** `optimizer` (as given), `layers` (the function selecting the stacked
    layers of a model) and `offload` (as given, or `None`)."""

    def __init__(self, optimizer: Optimizer, layers: Callable[[Any], Any],
                 offload: Optional[Offload] = None) -> None:
        self.optimizer = optimizer
        self.layers = layers
        self.offload = offload
        # the optimizer of the rest, kept by `offload`; the layers' is made per plan
        self._rest: Any = _normalised(optimizer, offload)
        self._plans: dict[Any, _Plan] = {}  # by the model's structure, shapes and layers

    def _returns_params(self) -> bool:
        return isinstance(self.optimizer, MasterWeights)

    def _update_rest(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        if isinstance(self._rest, (MasterWeights, HostWeightsOptimizer)):
            return self._rest.update(grads, state, params)
        updates, state = self._rest.update(grads, state, params)
        if any_on_host(jtu.tree_leaves(params)):
            return apply_updates(params, updates), state
        # (`eqx.apply_updates`, as the normal step: XLA:CPU may fuse the two otherwise.)
        return eqx.apply_updates(params, updates), state

    def _plan(self, model: Any) -> _Plan:
        params = eqx.filter(model, eqx.is_array)
        leaves, treedef = jtu.tree_flatten(params)
        selected = {id(a) for a in jtu.tree_leaves(self.layers(model))}
        in_layers = tuple(id(a) in selected for a in leaves)
        key = (treedef, tuple((a.shape, a.dtype) for a in leaves), in_layers)
        plan = self._plans.get(key)
        if plan is None:
            plan = _make_plan(self._rest, params, in_layers)
            self._plans[key] = plan
        return plan

    def init(self, model: _M) -> tuple[_M, BackwardState]:
        """The model to train (as the optimizer's own `init` gives it: `master_weights`
        casts it to the compute dtype) and the state: the optimizer's state of the
        stacked layers and of the rest, each made by the optimizer (in host memory
        where it keeps its state there).

        **Arguments:**

        - `model`: the model; `layers(model)` must be its stacked layers.

        **Returns:**

        `(model, state)`, the state a `BackwardState`.
        """
        params, static = eqx.partition(model, eqx.is_array)
        plan = self._plan(model)
        layers_half, rest_half = halves(params, plan.in_layers)
        new_layers, state_layers = _init_half(plan.layer_optimizer, layers_half)
        new_rest, state_rest = _init_half(self._rest, rest_half)
        check_not_accumulating((state_layers, state_rest))
        new_params = eqx.combine(eqx.filter(new_layers, eqx.is_array),
                                 eqx.filter(new_rest, eqx.is_array))
        new_model: _M = eqx.combine(new_params, static)
        return new_model, BackwardState(state_layers, state_rest)

    def step(self, loss: Callable[..., jax.Array], model: _M, state: BackwardState,
             *args: Any, accumulated: Optional[_M] = None,
             **kwargs: Any) -> tuple[jax.Array, _M, BackwardState]:
        """One training step: `loss(model, *args, **kwargs)` differentiated, the stacked
        layers updated inside its backward pass, the other parameters after it.

        **Arguments:**

        - `loss`: the loss, a scalar; it must run `scan_layers` once on exactly
            `layers(model)` (not a copy or a cast of it) and use the layers nowhere
            else.
        - `model`, `state`: as `init` or the previous `step` returned them.
        - `*args`, `**kwargs`: passed to `loss`.
        - `accumulated`: the gradient sum of earlier micro-batches (the structure of
            `eqx.filter(model, eqx.is_array)`, on the device), or `None`. Given, the
            step's gradient is `accumulated` plus this batch's, added layer by layer
            inside the backward pass (`scan_layers(accumulate=...)` makes the layers'
            part of such a sum on the earlier micro-batches).

        **Returns:**

        `(loss value, new model, new state)`.
        """
        if not isinstance(state, BackwardState):
            raise StateError(f"update_in_backward(...).step: got a {type(state).__name__} "
                             "state; pass the state that `init` (or the previous step) "
                             f"returned.\nSee {DOCS}.")
        params, static = eqx.partition(model, eqx.is_array)
        plan = self._plan(model)
        leaves = jtu.tree_leaves(params)
        block = [p for p, m in zip(leaves, plan.in_layers, strict=True) if m]
        rest = [None if m else p for p, m in zip(leaves, plan.in_layers, strict=True)]
        s_leaves = jtu.tree_leaves(state.layers)
        stored = [s for s, m in zip(s_leaves, plan.stacked, strict=True) if m]
        channel = [as_bits(s) for s in stored]
        shared = [s for s, m in zip(s_leaves, plan.stacked, strict=True) if not m]
        acc = None if accumulated is None else _accumulated_leaves(accumulated, plan)
        update = functools.partial(_layer_update, plan.transformation,
                                   self._returns_params(), plan)

        def differentiated(rest: list[Any], block: list[Any], channel: list[Any]) -> Any:
            hook = Hook(block, channel, shared, update, None if acc is None else
                        [a for a, m in zip(acc, plan.in_layers, strict=True) if m],
                        stored=stored if any(a.dtype == CODE_DTYPE for a in stored) else None)
            with hooked(hook):
                merged = _merge(block, rest, plan.in_layers)
                value = loss(eqx.combine(jtu.tree_unflatten(plan.treedef, merged), static),
                             *args, **kwargs)
            if hook.calls != 1:
                raise CompositionError(
                    "Run `eqx_offload.scan_layers` once, on exactly `layers(model)`, inside "
                    "the loss.\nupdate_in_backward(...).step: the loss ran it "
                    f"{hook.calls} times on those layers.\nSee {DOCS}.")
            return value

        # The loss traced once: checked, then differentiated as traced.
        traced = jax.make_jaxpr(differentiated)(rest, block, channel)
        _check_layers_only_scanned(traced, len(jtu.tree_leaves(rest)), len(block))
        value, vjp = eqx.filter_vjp(functools.partial(_replayed, traced), rest, block, channel)
        g_rest, new_block, new_channel = vjp(jnp.ones_like(value))
        if acc is not None:
            g_rest = [None if g is None else a + g for a, g in zip(acc, g_rest, strict=True)]
        rest_grads = jtu.tree_unflatten(plan.treedef, g_rest)  # (`None` where `rest` is)
        rest_params = jtu.tree_unflatten(plan.treedef, rest)
        new_rest, state_rest = self._update_rest(rest_grads, state.rest, rest_params)
        new_shared = _shared_update(plan.transformation, self._returns_params(), plan,
                                    block, stored, shared)
        new_channel = [from_bits(n, s) for n, s in zip(new_channel, stored, strict=True)]
        state_layers = jtu.tree_unflatten(plan.state_def,
                                          _merge(new_channel, new_shared, plan.stacked))
        new_params = _merge(new_block, jtu.tree_leaves(new_rest), plan.in_layers)
        new_model: _M = eqx.combine(jtu.tree_unflatten(plan.treedef, new_params), static)
        return value, new_model, BackwardState(state_layers, state_rest)


def _init_half(optimizer: Any, half: Any) -> tuple[Any, Any]:
    """`(params, state)` of one half of the parameters (the other half `None`)."""
    if isinstance(optimizer, MasterWeights):
        return optimizer.init(half)
    return half, optimizer.init(half)


_PASSING = frozenset({"device_put", "pjit", "jit", "closed_call", "custom_jvp_call"})


def _check_layers_only_scanned(jaxpr: Any, n_rest: int, n_block: int) -> None:
    """Refuses a loss that uses the stacked layers (`jaxpr`'s inputs after the first
    `n_rest`) otherwise than through the hooked scan: their "gradient" is the new
    weights, to which any other use's gradient would be added."""
    block = set(jaxpr.jaxpr.invars[n_rest:n_rest + n_block])
    where = _other_use(jaxpr.jaxpr, block)
    if where is not None:
        raise CompositionError(
            "Use the stacked layers only through `scan_layers` in the loss (read a "
            "copy elsewhere: `jax.lax.stop_gradient(model.blocks)`).\n"
            f"update_in_backward(...).step: the loss also uses them in `{where}`.\n"
            f"See {DOCS}.")


def _other_use(jaxpr: Any, block: set[Any]) -> Optional[str]:
    """The first primitive but the update scan's custom VJP that reads a variable of
    `block` (or a move of one), looking into nested calls; `None` if none."""
    block = set(block)
    for eqn in jaxpr.eqns:
        reads = [i for i, v in enumerate(eqn.invars) if not isinstance(v, Literal) and v in block]
        if not reads:
            continue
        name = eqn.primitive.name
        if name.startswith("custom_vjp_call"):
            continue
        if name == "device_put":
            block.update(eqn.outvars[i] for i in reads)
            continue
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if name in _PASSING and sub is not None:
            inner = getattr(sub, "jaxpr", sub)
            found = _other_use(inner, {inner.invars[i] for i in reads})
            if found is not None:
                return found
            continue
        return str(name)
    return None


def _replayed(traced: Any, rest: list[Any], block: list[Any], channel: list[Any]) -> Any:
    """The loss's value from its traced program `traced` (the step's `differentiated`)."""
    return jaxpr_as_fun(traced)(*jtu.tree_leaves((rest, block, channel)))[0]


def _merge(chosen: list[Any], others: list[Any], mask: tuple[bool, ...]) -> list[Any]:
    """Leaves where `mask` is true from `chosen`, in order; the rest from `others`
    (either a list of the rest only, or one as long as `mask`)."""
    chosen_it = iter(chosen)
    if len(others) == len(mask):
        return [next(chosen_it) if m else o for m, o in zip(mask, others, strict=True)]
    others_it = iter(others)
    return [next(chosen_it) if m else next(others_it) for m in mask]


def _make_plan(optimizer: Any, params: Any, in_layers: tuple[bool, ...]) -> _Plan:
    leaves, treedef = jtu.tree_flatten(params)
    if not any(in_layers):
        raise OptionError("update_in_backward(layers=...): pass a function that returns "
                          "the model's stacked layers (e.g. `lambda m: m.blocks`); it "
                          f"selected no array leaf.\nSee {DOCS}.")
    if any(m and not eqx.is_inexact_array(a) for a, m in zip(leaves, in_layers, strict=True)):
        raise OptionError("update_in_backward(layers=...): select stacked layers whose "
                          f"array leaves are all floating.\nSee {DOCS}.")
    lengths = {a.shape[0] if a.ndim else None
               for a, m in zip(leaves, in_layers, strict=True) if m}
    if len(lengths) != 1 or None in lengths:
        raise OptionError("update_in_backward(layers=...): select stacked layers (every "
                          "array leaf with the same leading axis, the number of layers)."
                          f"\nSee {DOCS}.")
    layers = int(next(iter(lengths)) or 0)
    layers_half, _ = halves(params, in_layers)
    layer_optimizer = _for_layers(optimizer, layers)
    transformation = _transformation(layer_optimizer)
    state = jax.eval_shape(transformation.init, layers_half)
    check_not_accumulating(state)
    check_separable(transformation, params, in_layers)
    # (`per_layer` makes one layer's state: an `offloaded` update of a layer finds its layout)
    per_leaf = tuple(per_layer(transformation, layers_half))
    return _Plan(treedef, in_layers, jtu.tree_structure(state), per_leaf, layers,
                 layer_optimizer, transformation)


def as_bits(a: Any) -> Any:
    """A state leaf as the step differentiates it: packed 8-bit codes (`uint32`) as the
    `float32` of the same bits (the new state comes back as a floating "gradient"), else
    as is. The layer scan reads and writes the stored leaves (`Hook.stored`)."""
    return jax.lax.bitcast_convert_type(a, jnp.float32) if a.dtype == CODE_DTYPE else a


def from_bits(a: Any, like: Any) -> Any:
    """`as_bits` undone: `a` as the dtype of the leaf `like`."""
    return jax.lax.bitcast_convert_type(a, like.dtype) if like.dtype == CODE_DTYPE else a


def _accumulated_leaves(accumulated: Any, plan: _Plan) -> list[Any]:
    leaves = jtu.tree_leaves(eqx.filter(accumulated, eqx.is_array), is_leaf=lambda x: x is None)
    structure = jtu.tree_structure(eqx.filter(accumulated, eqx.is_array))
    if structure != plan.treedef:
        raise OptionError("update_in_backward(...).step(accumulated=...): pass a sum of "
                          "the structure of eqx.filter(model, eqx.is_array).\n"
                          f"See {DOCS}.")
    return [a for a in leaves if a is not None]


def _tree(plan: _Plan, block: list[Any]) -> Any:
    """The parameters' tree with the layers' leaves `block` and `None` elsewhere."""
    return jtu.tree_unflatten(plan.treedef, _merge(block, [None] * len(plan.in_layers),
                                                   plan.in_layers))


def _layer_update(transformation: optax.GradientTransformationExtraArgs, returns_params: bool,
                  plan: _Plan, g: list[Any], w: list[Any], s: list[Any],
                  shared: list[Any]) -> tuple[list[Any], list[Any]]:
    """One layer's update (each leaf with a leading axis of 1): its new weights and its
    new per-layer state leaves (as stored, as `s` is)."""
    state = jtu.tree_unflatten(plan.state_def, _merge(s, shared, plan.stacked))
    result, new_state = transformation.update(_tree(plan, g), state, _tree(plan, w))
    result_leaves = jtu.tree_leaves(result)
    new_w = result_leaves if returns_params else [
        p + u for p, u in zip(w, result_leaves, strict=True)]
    # (packed 8-bit state row-major, as stored: XLA:TPU would give the codec's transposed
    # layout to the layer scan's carried slice, and so to the whole stack in host memory)
    new_s = [with_layout_constraint(a, Layout(tuple(range(a.ndim)))) if a.dtype == CODE_DTYPE
             else a for a, m in zip(jtu.tree_leaves(new_state), plan.stacked, strict=True) if m]
    return new_w, new_s


def _shared_update(transformation: optax.GradientTransformationExtraArgs, returns_params: bool,
                   plan: _Plan, block: list[Any], stored: list[Any],
                   shared: list[Any]) -> list[Any]:
    """The new shared leaves of the layers' state (a step count): the update of one
    layer computes them from the shared leaves alone (`check_separable` made sure), so
    the update of layer 0 on a zero gradient, of which XLA keeps only them."""
    if not shared:
        return []
    first = [a[:1] for a in block]
    zeros = [jnp.zeros_like(a) for a in first]
    slices = [s[:1] for s in stored]
    state = jtu.tree_unflatten(plan.state_def, _merge(slices, shared, plan.stacked))
    _, new_state = transformation.update(_tree(plan, zeros), state, _tree(plan, first))
    new = [a for a, m in zip(jtu.tree_leaves(new_state), plan.stacked, strict=True) if not m]
    # (one layer's update leaves its state on the device: each back where it lives)
    return [send_to_host(n) if is_host(o) else n for n, o in zip(new, shared, strict=True)]


# pytype: disable=not-indexable  # (pytype reads `_M` above as no TypeVar)
def update_in_backward(optimizer: Optimizer, layers: Callable[[Any], Any], *,
                       offload: Optional[Offload] = None) -> BackwardUpdate[_M]:
    # pytype: enable=not-indexable
    """Runs the optimizer step of a model's stacked layers inside its backward pass,
    layer by layer, so that their whole gradient never exists on the device.

    As the backward scan of `eqx_offload.scan_layers` makes layer `i`'s gradient, layer
    `i`'s optimizer state (and master weights) comes to the device, is updated with
    it, and goes back to host memory with the new weights, while the layers below
    still compute. The other parameters (embeddings, head, norms) are updated after the
    backward pass, as in the normal step. The result is bitwise the normal step's (grad,
    then `update`, then `apply_updates`; on the CPU, docs/models.md says where else) for
    any optimizer that treats each parameter, and each layer of a stacked one, apart
    (Adam, AdamW with masks, Lion, SGD with momentum, ...): checked from the jaxpr of its
    update, which refuses the rest (`clip_by_global_norm`) with a `CompositionError`.

    **Arguments:**

    - `optimizer`: an optax transformation, e.g. `optax.adamw(1e-3)`, or what `master_weights`
        or `host_weights_optimizer` returns; not a `MultiSteps` (`step(accumulated=)`).
    - `layers`: a function from the model to its stacked layers (the `layers` its loss
        passes to `scan_layers`), e.g. `lambda m: m.blocks`.
    - `offload`: how the optimizer's state is kept: a function from a transformation
        to one, e.g. `eqx_offload.offloaded` or `functools.partial(eqx_offload.offloaded,
        host_dtype=jnp.int8)`; `None` (default): as `optimizer` keeps it.

    **Returns:**

    A `BackwardUpdate`: `init(model) -> (model, state)` and
    `step(loss, model, state, *args) -> (loss value, model, state)`.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import optax
        import eqx_offload

        class Model(eqx.Module):
            blocks: eqx.nn.Linear
            def __call__(self, x):
                return eqx_offload.scan_layers(self.blocks, x)

        blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(
            jax.random.split(jax.random.key(0), 3))
        opt = eqx_offload.update_in_backward(
            optax.adamw(1e-2), layers=lambda m: m.blocks, offload=eqx_offload.offloaded)
        model, state = opt.init(Model(blocks))

        def loss(model, x):
            return jnp.sum(model(x) ** 2)

        @eqx_offload.filter_jit(donate="all")
        def step(model, state, x):
            return opt.step(loss, model, state, x)

        value, model, state = step(model, state, jnp.ones(4))
        ```
    """
    if not callable(layers):
        raise OptionError(f"update_in_backward(layers={layers!r}): pass a function from "
                          f"the model to its stacked layers, e.g. `lambda m: m.blocks`.\n"
                          f"See {DOCS}.")
    if offload is not None and not callable(offload):
        raise OptionError(f"update_in_backward(offload={offload!r}): pass a function from "
                          "a transformation to a transformation (e.g. "
                          f"eqx_offload.offloaded), or None.\nSee {DOCS}.")
    if not isinstance(optimizer, (optax.GradientTransformation, optax.MultiSteps,
                                  MasterWeights, HostWeightsOptimizer)):
        raise not_a_transformation_error("update_in_backward(optimizer=...)", optimizer)
    return BackwardUpdate(optimizer, layers, offload)

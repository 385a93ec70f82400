"""Parameters in host memory outside a layer scan, and the rest of the step.

- `HostWeights` / `host_weights`: one module of an unscanned model whose weights live in
  `pinned_host` and come to the device only while it computes (`scan_layers`, in
  `_models/scan.py`, does the same for stacked layers).
- `host_weights_optimizer`: `init`/`update` for a model with host-resident parameters
  (each waits for its gradient; the update is added on the device).
- `apply_updates`: `eqx.apply_updates` that keeps every leaf in the memory it lives in.

The gradient of a weight in host memory is in host memory (`pinned_host`): JAX
transposes the `device_put` that fetched it into a `device_put` back to host.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, cast, Generic, Optional, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
import optax

from .._core.errors import OptionError
from .._core.inner import as_transformation
from .._core.leaves import is_none, is_traced
from .._core.move import destination, move, put, to_host
from .._core.placement import is_host, memory_kind_of
from .._core.types import HostMemoryKind, Where
from .._optim.offloaded import offloaded
from .remat import Policy


_T = TypeVar("_T")
_M = TypeVar("_M")


def fetch(tree: _T) -> _T:
    """Every array leaf of `tree` in the device's default memory (those there already
    are not copied)."""
    return move(tree, True, None, "to_device")


class HostWeights(eqx.Module, Generic[_M]):
    """A module whose weights in host memory come to the device when it is called.

    The call brings every host-resident array leaf of `module` to the device, calls
    `module` there, and is rematted (`jax.checkpoint`), so the backward pass fetches the
    weights again rather than keeping the device copies alive between the two passes.
    Gradients with respect to `module`'s host-resident leaves are in host memory
    (`pinned_host`). Build it with `eqx_offload.host_weights`, which also moves the
    weights; `HostWeights(module)` wraps a module as it is.

    **Fields:**

    - `module`: the wrapped module (any callable pytree).
    - `policy`: the remat policy of the call (default `None`: save nothing).
    """

    module: _M
    policy: Optional[Policy] = eqx.field(static=True, default=None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dynamic, static = eqx.partition(self.module, eqx.is_array)

        def run(dynamic: Any, args: Any, kwargs: Any) -> Any:
            module: Any = eqx.combine(fetch(dynamic), static)
            return module(*args, **kwargs)

        return eqx.filter_checkpoint(run, policy=self.policy)(dynamic, args, kwargs)


def host_weights(
    module: _M, where: Where = True, *, policy: Optional[Policy] = None,
    memory_kind: HostMemoryKind = "pinned_host",
) -> HostWeights[_M]:
    """Moves the selected weights of `module` to host memory and wraps it in a
    `HostWeights`, so they come to the device only while it computes.

    **Arguments:**

    - `module`: any callable Equinox module (a layer, a block, a whole model).
    - `where`: which array leaves to keep in host memory (see `to_host`). Default every
        array.
    - `policy`: the remat policy of the call (see `HostWeights`).
    - `memory_kind`: `"pinned_host"` (default) or `"unpinned_host"` (eager use only).

    **Returns:**

    A `HostWeights` around the moved module.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqx_offload

        mlp = eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(0))
        mlp = eqx.tree_at(lambda m: m.layers[1], mlp,
                          replace_fn=eqx_offload.host_weights)
        grads = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x))))(
            mlp, jnp.ones(4))
        assert grads.layers[1].module.weight.sharding.memory_kind == "pinned_host"
        assert grads.layers[0].weight.sharding.memory_kind == "device"
        ```
    """
    return HostWeights(to_host(module, where, memory_kind=memory_kind), policy)


# ----------------------------------------------------------------------------------------
# The rest of the step


def apply_updates(model: _T, updates: Any) -> _T:
    """`eqx.apply_updates` that keeps every leaf in the memory it lives in.

    A parameter in host memory is updated on the device: it and its update come to
    the device, are added there, and the sum goes back to the parameter's memory kind.
    Parameters on the device are updated as `eqx.apply_updates` does (an update in host
    memory is brought to the device first). The result is bitwise that of
    `eqx.apply_updates` on the same values; `eqx.apply_updates` itself would add host
    arrays, which `eqx_offload.filter_jit` refuses (and XLA runs on the host). A pure
    function: the same program under any `jit` (`host_weights_optimizer` makes each host weight
    wait for its gradient first).

    **Arguments:**

    - `model`: the model (or any pytree of parameters); non-array leaves are kept.
    - `updates`: a pytree prefix-compatible with `model` as for `eqx.apply_updates`,
        with `None` where nothing changes.

    **Returns:**

    The updated model, each array leaf in the memory kind of `model`'s leaf.

    !!! Example

        ```python
        import jax.numpy as jnp
        import eqx_offload

        params = eqx_offload.to_host({"w": jnp.ones(3), "b": jnp.ones(3)}, where={"w": True, "b": False})
        new = eqx_offload.apply_updates(params, {"w": jnp.ones(3), "b": jnp.ones(3)})
        assert new["w"].sharding.memory_kind == "pinned_host"
        assert new["b"].sharding.memory_kind == "device"
        ```
    """
    return _add_updates(model, updates, model)


def _add_updates(model: _T, updates: Any, values: Any) -> _T:
    """`apply_updates(model, updates)`, adding to the leaves of `values` (`model` itself,
    or its parameters after the wait for their gradients) and sending each sum to the
    memory kind of `model`'s leaf."""
    pairs_def: Any = jtu.tree_structure(updates, is_leaf=is_none)  # (PyTreeDef: untyped)
    p_leaves = pairs_def.flatten_up_to(model)
    v_leaves = pairs_def.flatten_up_to(values)
    u_leaves = jtu.tree_leaves(updates, is_leaf=is_none)
    home = [memory_kind_of(p) if is_host(p) else None for p in p_leaves]
    touched = [i for i, u in enumerate(u_leaves) if u is not None]
    fetched_p, fetched_u = fetch(([v_leaves[i] for i in touched],
                                   [u_leaves[i] for i in touched]))
    sums = [p + u for p, u in zip(fetched_p, fetched_u, strict=True)]
    sums = put(sums, [None if home[j] is None else
                      destination(x, home[j], "apply_updates", str(j))
                      for x, j in zip(sums, touched, strict=True)])
    new_leaves = list(p_leaves)
    for i, x in zip(touched, sums, strict=True):
        new_leaves[i] = x
    out: _T = pairs_def.unflatten(new_leaves)
    return out


def _after_gradients(params: _T, grads: Any) -> _T:
    """`params` with each traced host-resident leaf made to wait for its gradient (the
    leaf of `grads` at the same place) by a `jax.lax.optimization_barrier`, which passes
    values through unchanged.

    Without the wait XLA's GPU scheduler may start the update's copy of a weight before
    the forward pass and hold it on the device through both passes; with it the copy
    comes after the backward pass made the gradient ("Why the prefetch once raised the
    peak" in `docs/models.md`). `HostWeightsOptimizer.update` hands the waited value to both the
    inner update and the add, so XLA copies each parameter once."""

    def wait(p: Any, g: Any) -> Any:
        if p is None or g is None or not is_traced(p) or not is_host(p) or not eqx.is_array(g):
            return p
        waited, _ = jax.lax.optimization_barrier((p, g))
        return waited

    try:
        out: _T = jtu.tree_map(wait, params, grads, is_leaf=is_none)
    except ValueError:  # not the same structure: nothing to pair
        return params
    return out


def fetch_each(tree: _T) -> _T:
    """`fetch`, one `device_put` per traced leaf, and unconditional: traced on
    `ShapeDtypeStruct`s that say nothing of memory (as the streamed update traces
    `inner.update`), the move is still in the program, and each leaf's move belongs to
    its own parameter (so the streamed update fetches it with that parameter's group)."""
    leaves, treedef = jtu.tree_flatten(tree)
    traced = [i for i, x in enumerate(leaves) if is_traced(x)]
    for i in traced:
        leaves[i] = jax.device_put(leaves[i], jax.memory.Space.Device)
    rest = [i for i, x in enumerate(leaves) if i not in set(traced) and eqx.is_array(x)]
    for i, x in zip(rest, fetch([leaves[i] for i in rest]), strict=True):
        leaves[i] = x
    out: _T = jtu.tree_unflatten(treedef, leaves)
    return out


def _fetching(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`inner`, with host-resident `params` and `updates` brought to the device (one
    move per leaf) before it runs: its state and updates are bitwise those of `inner`."""
    transformation = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> optax.OptState:
        return transformation.init(fetch_each(params))

    def update_fn(
        updates: optax.Updates, state: optax.OptState, params: Optional[optax.Params] = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        return transformation.update(
            fetch_each(updates), state, fetch_each(params), **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class HostWeightsOptimizer(Generic[_M]):
    """What `host_weights_optimizer` returns: `init` and `update` for a model whose parameters
    (some or all) live in host memory. (Not an `optax.GradientTransformation`: its
    update makes each host weight wait for its gradient and adds the update to that
    waited value, which an optax update cannot hand to `apply_updates`.)

    **Fields:**

    - `transformation`: the optax transformation of the parameters (`inner`, bringing
        host-resident parameters and gradients to the device, wrapped by `offload`).
    """

    transformation: optax.GradientTransformationExtraArgs

    def init(self, model: Any) -> Any:
        """The state for `model` (its array leaves), as `transformation.init`."""
        return self.transformation.init(eqx.filter(model, eqx.is_array))

    def update(self, grads: Any, state: Any, model: _M, **extra_args: Any) -> tuple[_M, Any]:
        """One optimizer step: each host-resident parameter waits for its gradient (a
        `jax.lax.optimization_barrier`, in a traced step), the inner update runs on the
        device with that waited value, and the update is added to it on the device;
        each new parameter goes back to the memory kind of the old one.

        **Arguments:**

        - `grads`: gradients with respect to `model` (e.g.
            `eqx.filter_grad(loss)(model, ...)`); those of host weights may be in host
            memory.
        - `state`: the state `init` or the previous `update` returned.
        - `model`: the model the gradients belong to.
        - `**extra_args`: passed to the inner transformation.

        **Returns:**

        `(new_model, new_state)`: bitwise `inner`'s step with `eqx.apply_updates`.
        """
        params, static = eqx.partition(model, eqx.is_array)
        waited = _after_gradients(params, grads)
        updates, state = self.transformation.update(grads, state, waited, **extra_args)
        new_params = _add_updates(params, updates, waited)
        return cast(_M, eqx.combine(new_params, static)), state


def host_weights_optimizer(
    inner: optax.GradientTransformation,
    *,
    offload: Optional[Callable[[optax.GradientTransformation],
                               optax.GradientTransformation]] = offloaded,
) -> HostWeightsOptimizer[Any]:
    """Trains a model whose parameters live in host memory (`host_weights`,
    `scan_layers`, `to_host`), with `inner`'s state kept by `offload`.

    The update brings host-resident gradients and parameters to the device (one move
    per leaf, so a streamed `offloaded` fetches each with its parameter's group of
    state), runs `inner` there, adds the update on the device and sends each sum back
    to the memory its parameter lives in. In a traced step each host weight first
    waits for its gradient (a `jax.lax.optimization_barrier`, which passes values
    unchanged) and that one value feeds both the update and the add, so XLA copies each
    weight to the device once, after the backward pass made its gradient (why: "Why
    the prefetch once raised the peak" in `docs/models.md`). The new model and the
    state are bitwise those of `inner` with `eqx.apply_updates`.

    **Arguments:**

    - `inner`: any `optax.GradientTransformation`, e.g. `optax.adamw(1e-3)`.
    - `offload`: how `inner`'s state is kept: a function from a transformation to one,
        default `eqx_offload.offloaded` (in host memory); e.g.
        `functools.partial(eqx_offload.offloaded, group_bytes=64 << 20)` to stream the
        update, or `None` to keep it on the device.

    **Returns:**

    A `HostWeightsOptimizer` with `init(model) -> state` and
    `update(grads, state, model) -> (new_model, new_state)`.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import optax
        import eqx_offload

        model = eqx_offload.to_host(eqx.nn.Linear(4, 4, key=jax.random.key(0)))
        hp = eqx_offload.host_weights_optimizer(optax.adamw(1e-2))
        state = hp.init(model)

        @eqx_offload.filter_jit(donate="all")
        def step(model, state, x):
            loss = lambda m: jnp.sum(eqx_offload.to_device(m)(x) ** 2)
            return hp.update(eqx.filter_grad(loss)(model), state, model)

        model, state = step(model, state, jnp.ones(4))
        assert model.weight.sharding.memory_kind == "pinned_host"
        ```
    """
    if offload is not None and not callable(offload):
        raise OptionError(f"host_weights_optimizer(offload={offload!r}): pass a function from a "
                          "transformation to a transformation (e.g. eqx_offload.offloaded), "
                          "or None.")
    transformation = _fetching(as_transformation(inner, "host_weights_optimizer(inner=...)"))
    if offload is not None:
        transformation = optax.with_extra_args_support(offload(transformation))
    return HostWeightsOptimizer(transformation)


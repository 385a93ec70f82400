"""`nnx_jit`: `flax.nnx.jit` for a step that updates an offloaded optimizer in place,
compiled once.

`nnx.jit` calls `jax.jit`, which keys its cache on whether each array argument is
committed to a device. A host-memory array always is (the offloaded state), so every
output of such a step comes back committed, while what a program makes outside the step
is not: a fresh model, the optimizer's step counter, `nnx.MultiMetric`'s totals (again
after each `reset()`), an `nnx.Rngs`' key. Each new combination compiles the step
again. `nnx_jit` commits every uncommitted array of the call's arguments (in place, for
NNX objects) where `jax.jit` would run it, before `nnx.jit`'s call: the step sees
committed arrays only, and compiles once.
"""

import functools
from collections.abc import Callable
from typing import Any, Optional, overload, TypeVar

import jax
import jax.tree_util as jtu

from .._core.move import put
from .._core.placement import input_shardings, is_committed


_F = TypeVar("_F", bound=Callable[..., Any])


@overload
def nnx_jit(fun: None = None, **jit_kwargs: Any) -> Callable[[_F], _F]: ...
@overload
def nnx_jit(fun: _F, **jit_kwargs: Any) -> _F: ...
def nnx_jit(fun: Optional[_F] = None, **jit_kwargs: Any) -> Any:
    """`flax.nnx.jit` (same arguments) that compiles a step once with an offloaded
    optimizer among its arguments.

    Each call first commits the uncommitted arrays of its arguments (NNX objects in
    place; a committed array is left as it is, and a NumPy batch too) to the device
    `jax.jit` would run them on; then it calls `nnx.jit(fun, **jit_kwargs)`. Without
    this, `nnx.jit` compiles such a step again whenever an argument comes back committed
    from the step (the model, the metrics, the `nnx.Rngs`) or is made anew
    (`metrics.reset()`), because JAX commits every host-memory array and so every
    output of a step that reads one. Nothing else changes: the step, its donation
    (none with an offloaded optimizer: docs "Flax NNX") and its results are `nnx.jit`'s.

    **Arguments:**

    - `fun`: the step, as for `nnx.jit` (or none: `@eqx_offload.nnx_jit(...)`).
    - `jit_kwargs`: `nnx.jit`'s keyword arguments.

    **Returns:**

    The jitted step.

    !!! Example

        ```python
        import optax
        from flax import nnx
        import eqx_offload

        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, eqx_offload.offloaded(optax.adam(1e-3)),
                                  wrt=nnx.Param)

        @eqx_offload.nnx_jit
        def train_step(model, optimizer, x):
            grads = nnx.grad(lambda m: (m(x) ** 2).mean())(model)
            optimizer.update(model, grads)
        ```
    """
    if fun is None:
        return functools.partial(nnx_jit, **jit_kwargs)
    from flax import nnx  # (an optional dependency: `pip install "eqx_offload[flax]"`)

    jitted = nnx.jit(fun, **jit_kwargs)

    @functools.wraps(fun)
    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _committed(nnx, args, kwargs)
        return jitted(*args, **kwargs)

    return call


def _committed(nnx: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`(args, kwargs)` with every uncommitted `jax.Array` committed where `jax.jit`
    would place it among the committed ones (`placement.input_shardings`); an NNX
    object's arrays are replaced in it (`nnx.update`), as `nnx.jit` writes a step's
    results back."""
    arguments = [*args, *kwargs.values()]
    nodes = [nnx.graph.is_graph_node(a) for a in arguments]
    # An NNX object's state; any other argument as it is (an NNX object inside it left
    # as it is: only `nnx.jit` can write into it).
    flat = [jtu.tree_flatten(nnx.state(a)) if node else
            jtu.tree_flatten(a, is_leaf=nnx.graph.is_graph_node)
            for a, node in zip(arguments, nodes)]
    leaves = [x for tree, _ in flat for x in tree]
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    if all(is_committed(leaves[i]) for i in arrays):
        return args, kwargs
    chosen = [leaves[i] for i in arrays]
    targets = [None if is_committed(x) else s
               for x, s in zip(chosen, input_shardings(chosen), strict=True)]
    for i, x in zip(arrays, put(chosen, targets), strict=True):
        leaves[i] = x
    trees: list[Any] = []
    start = 0
    for a, node, (tree, treedef) in zip(arguments, nodes, flat):
        trees.append(jtu.tree_unflatten(treedef, leaves[start:start + len(tree)]))
        start += len(tree)
        if node:
            nnx.update(a, trees[-1])
    out = [a if node else tree for a, node, tree in zip(arguments, nodes, trees)]
    return tuple(out[:len(args)]), dict(zip(kwargs, out[len(args):]))

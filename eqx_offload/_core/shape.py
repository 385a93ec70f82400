"""Abstract values that keep where each array would live: `filter_eval_shape` (an
`eqx.filter_eval_shape` whose `jax.ShapeDtypeStruct`s carry shardings and memory kinds)
and the abstract state of an optimizer, with the host pool check of `init`."""

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu

from .leaves import paths_parts
from .memory import check_tree_fits_host_pool, host_pool_limit, platform_of
from .placement import input_shardings, output_shardings, typed_sharding


_T = TypeVar("_T")


def is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def is_arraylike(x: Any) -> bool:
    return eqx.is_array(x) or is_abstract(x)


def check_init_fits_host_pool(init: Any, params: Any, what: str) -> None:
    """On CUDA/ROCm, raise a `MemoryKindError` naming `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`
    if `init(params)` would place more `pinned_host` bytes than XLA's pinned host pool
    has left (the state is traced, not made); off those platforms nothing is done."""
    leaves = jtu.tree_leaves(params, is_leaf=is_abstract)
    if host_pool_limit(platform_of(leaves)) is None:
        return
    target = abstract_state(_InitOnly(init), params)
    check_tree_fits_host_pool(jtu.tree_leaves(target, is_leaf=is_abstract), what)


class _InitOnly:
    """What `abstract_state` needs of an optimizer: its `init`."""

    def __init__(self, init: Any) -> None:
        self.init = init


def abstract_state(optimizer: Any, params: Any) -> Any:
    """`abstract_init` without the host pool check (`offloaded(...).init` checks it
    itself, naming itself)."""
    return filter_eval_shape(optimizer.init, params)


def filter_eval_shape(fun: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """`eqx.filter_eval_shape` that keeps where each array would live: what
    `fun(*args, **kwargs)` would return, with a `jax.ShapeDtypeStruct` at every array
    leaf that carries the sharding and memory kind the real call gives it. Nothing is
    computed or allocated, so a model or an optimizer state of any size can be
    described on a laptop, and planned (`eqx_offload.planner.gpu_plan` takes the result) or
    restored into (`abstract_init` is this of `optimizer.init`).

    **Arguments:**

    - `fun`: any function, e.g. a model's constructor (`lambda: Model(key)`),
        `optimizer.init`, `eqx_offload.master_weights(...).init`.
    - `*args`, `**kwargs`: its arguments: arrays, `jax.ShapeDtypeStruct`s (with a
        sharding, or on the default device without one) and anything else (passed as
        is).

    **Returns:**

    `fun`'s result with `jax.ShapeDtypeStruct` array leaves. Their memory kinds are the
    traced program's (`eqx_offload.to_host` inside `fun` gives `pinned_host`), their
    layouts those of an input of the same shape (a state mirrors its parameters'
    mesh and `PartitionSpec`), or the default device.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import optax
        import eqx_offload

        def make():
            model = eqx.nn.MLP(8192, 8192, 8192, 4, key=jax.random.key(0))  # 336M params
            return eqx.tree_at(lambda m: m.layers[1:], model, replace_fn=eqx_offload.to_host)

        model = eqx_offload.checkpoint.filter_eval_shape(make)
        assert model.layers[1].weight.sharding.memory_kind == "pinned_host"
        opt = eqx_offload.offloaded(optax.adamw(1e-3))
        state = eqx_offload.checkpoint.filter_eval_shape(lambda m: opt.init(eqx.filter(m, eqx.is_array)),
                                              model)
        assert state.inner_state[0].mu.layers[0].weight.sharding.memory_kind == "pinned_host"
        ```
    """
    dynamic, static = eqx.partition((args, kwargs), is_arraylike, is_leaf=is_abstract)
    leaves, treedef = jtu.tree_flatten(dynamic, is_leaf=is_abstract)
    in_shardings = input_shardings(leaves)
    abstract_in = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=getattr(x, "weak_type", False))
        for x, s in zip(leaves, in_shardings)
    ]
    out_parts: list[Any] = []

    def flat_fun(*flat: Any) -> list[Any]:
        call_args, call_kwargs = eqx.combine(jtu.tree_unflatten(treedef, flat), static)
        dynamic_out, static_out = eqx.partition(fun(*call_args, **call_kwargs), eqx.is_array)
        keyed, out_treedef = jtu.tree_flatten_with_path(dynamic_out)
        out_parts[:] = [static_out, out_treedef, paths_parts([p for p, _ in keyed])]
        return [x for _, x in keyed]

    out_avals = jax.jit(flat_fun).trace(*abstract_in).jaxpr.out_avals
    static_out, out_treedef, out_paths = out_parts
    # The paths as `filter_jit` sees them (`(0, ...)`: the first argument), so that the
    # layouts chosen here are those a jitted call chooses (`offloaded`'s `init`).
    in_paths = paths_parts([p[1:] for p, _ in jtu.tree_flatten_with_path(
        jtu.tree_unflatten(treedef, leaves), is_leaf=is_abstract)[0]])
    out_shardings = output_shardings(
        out_avals, out_paths, [jax.typeof(x) for x in abstract_in], in_paths, in_shardings
    )
    abstract_out = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=typed_sharding(s), weak_type=a.weak_type)
        for a, s in zip(out_avals, out_shardings)
    ]
    result: _T = eqx.combine(jtu.tree_unflatten(out_treedef, abstract_out), static_out)
    return result


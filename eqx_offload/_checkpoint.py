"""Restoring checkpoints straight into host memory: restore targets that carry host
shardings (for orbax) and a deserialise filter spec (for `eqx.tree_deserialise_leaves`).

Neither orbax nor Equinox records memory kinds: orbax's metadata keeps the mesh and
`PartitionSpec` but not the memory, and `eqx.default_deserialise_filter_spec` loads every
array onto the default device. Restored naively, an offloaded state arrives whole in
device memory. The helpers here say where each leaf goes before it is read.
"""

from collections.abc import Callable
from typing import Any, BinaryIO, Optional, TypeVar, Union

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
import optax

from ._core.compat import single_device_sharding
from ._core.errors import CheckpointError, checkpoint_leaf_error
from ._core.inner import as_transformation
from ._core.leaves import path_to_str
from ._core.memory import check_devices_offer, check_host_kind, check_tree_fits_host_pool, default_device
from ._core.placement import typed_sharding
from ._core.shape import abstract_state, filter_eval_shape as filter_eval_shape, is_abstract, is_arraylike
from ._core.types import HostMemoryKind, Where
from ._models.backward import BackwardUpdate
from ._models.master import MasterWeights
from ._models.params import HostWeightsOptimizer
from ._core.where import leaf_mask


_T = TypeVar("_T")


def _sharding_of(leaf: Any) -> jax.sharding.Sharding:
    """Where a leaf is (a `jax.Array`) or is meant to be (a `jax.ShapeDtypeStruct` with a
    sharding); the default device otherwise."""
    if isinstance(leaf, jax.Array):
        return leaf.sharding
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
        sharding: jax.sharding.Sharding = leaf.sharding
        return sharding
    return single_device_sharding(default_device())


def _stand_in(leaf: Any) -> Any:
    """An array the `where` filters can look at in place of an abstract leaf: the right
    shape and dtype, no memory (a broadcast view of one element)."""
    if is_abstract(leaf):
        return np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)
    return leaf


def host_shardings(
    tree: Any, where: Where = True, *, memory_kind: HostMemoryKind = "pinned_host"
) -> Any:
    """The shardings to restore a pytree into, with the selected leaves in host memory.

    Each array leaf (a `jax.Array`, or a `jax.ShapeDtypeStruct` with a sharding) keeps
    its mesh and `PartitionSpec`; the leaves selected by `where` get `memory_kind`, the
    others keep their own memory kind. A leaf without a sharding (a NumPy array, a
    `ShapeDtypeStruct` from `jax.eval_shape`) is placed on the default device.

    Pass the result where a restore API takes shardings, e.g. orbax's
    `ocp.checkpoint_utils.construct_restore_args(target, host_shardings(target, ...))`;
    or use `restore_target`, which builds the abstract target in one go.

    **Arguments:**

    - `tree`: a pytree of arrays or `jax.ShapeDtypeStruct`s (e.g. a state restored
        without host shardings, whose leaves sit in device memory).
    - `where`: which leaves go to host memory (see `to_host`). Default: every array.
        For an `offloaded` state, pass the inner state and the `where` of `offloaded`
        (default `eqx_offload.min_ndim(1)`), or use `abstract_init`.
    - `memory_kind`: `"pinned_host"` (default) or `"unpinned_host"`.

    **Returns:**

    A pytree of the same structure with a `jax.sharding.Sharding` at every array leaf
    and `None` at every other leaf.

    **Raises:**

    `MemoryKindError` if a device of a selected leaf lacks `memory_kind`; `WhereError`
    for a bad `where`.

    !!! Example

        ```python
        import jax.numpy as jnp
        import optax
        import eqx_offload

        state = optax.adam(1e-3).init({"w": jnp.ones((4, 4))})  # e.g. restored on device
        shardings = eqx_offload.checkpoint.host_shardings(state, eqx_offload.min_ndim(1))
        assert shardings[0].mu["w"].memory_kind == "pinned_host"
        assert shardings[0].count.memory_kind == "device"
        ```
    """
    leaves, treedef, shardings = _flat_host_shardings(tree, where, memory_kind)
    return jtu.tree_unflatten(treedef, shardings)


def _flat_host_shardings(
    tree: Any, where: Where, memory_kind: str
) -> tuple[list[Any], Any, list[Optional[jax.sharding.Sharding]]]:
    check_host_kind(memory_kind, "memory_kind")
    keyed, treedef = jtu.tree_flatten_with_path(tree, is_leaf=is_abstract)
    mask = leaf_mask(jtu.tree_unflatten(treedef, [_stand_in(x) for _, x in keyed]), where)
    shardings: list[Optional[jax.sharding.Sharding]] = []
    for (path, leaf), selected in zip(keyed, mask):
        if not is_arraylike(leaf):
            shardings.append(None)
            continue
        sharding = _sharding_of(leaf)
        if selected:
            check_devices_offer(
                sharding.addressable_devices, memory_kind, "memory_kind", path_to_str(path)
            )
            sharding = sharding.with_memory_kind(memory_kind)
        shardings.append(typed_sharding(sharding))
    return [x for _, x in keyed], treedef, shardings


def restore_target(
    tree: _T, where: Where = False, *, memory_kind: HostMemoryKind = "pinned_host"
) -> _T:
    """An abstract restore target: the pytree with a `jax.ShapeDtypeStruct` at every array
    leaf that carries the sharding and memory kind the restored leaf must have.

    Built from a concrete template (e.g. the model, or `opt.init(params)`), every leaf
    keeps its placement; `where` additionally sends leaves to host memory. Orbax restores
    each shard straight into that memory (no full-size device copy on the way, no memory
    kind mismatch at the next step); `eqx.tree_deserialise_leaves` does the same with
    `filter_spec=eqx_offload.checkpoint.deserialise_filter_spec`.

    **Arguments:**

    - `tree`: a pytree of arrays and/or `jax.ShapeDtypeStruct`s; other leaves are kept.
    - `where`: leaves to send to host memory on top of those already there (see
        `to_host`). Default `False`: every leaf keeps its own memory kind.
    - `memory_kind`: `"pinned_host"` (default) or `"unpinned_host"`.

    **Returns:**

    A pytree of the same structure.

    !!! Example

        ```python
        import jax.numpy as jnp
        import optax
        import orbax.checkpoint as ocp
        import eqx_offload

        params = {"w": jnp.ones((4, 4))}
        opt = eqx_offload.offloaded(optax.adam(1e-3))
        target = eqx_offload.checkpoint.restore_target(opt.init(params))
        assert target.inner_state[0].mu["w"].sharding.memory_kind == "pinned_host"
        # state = ocp.StandardCheckpointer().restore(path, target)
        ```
    """
    leaves, treedef, shardings = _flat_host_shardings(tree, where, memory_kind)
    target: _T = jtu.tree_unflatten(treedef, [
        jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=sharding, weak_type=getattr(leaf, "weak_type", False)
        )
        if sharding is not None
        else leaf
        for leaf, sharding in zip(leaves, shardings)
    ])
    check_tree_fits_host_pool(jtu.tree_leaves(target, is_leaf=is_abstract), "restore_target(...)")
    return target


# pytype: disable=not-indexable  # (pytype reads BackwardUpdate as not generic)
def abstract_init(
    optimizer: Union[optax.GradientTransformation, HostWeightsOptimizer[Any], MasterWeights[Any],
                     BackwardUpdate[Any]],
    # pytype: enable=not-indexable
    params: Any,
) -> Any:
    """The state `optimizer.init(params)` would return, without making it.

    Every array leaf is a `jax.ShapeDtypeStruct` carrying the sharding and memory kind the
    real `init` gives it: for `offloaded(...)`, the selected leaves in host memory with
    the mesh and `PartitionSpec` of the parameter they mirror. This is the restore
    target for an optimizer state: `ocp.args.StandardRestore(abstract_init(opt, params))`,
    or `like=` for `eqx.tree_deserialise_leaves`.

    **Arguments:**

    - `optimizer`: an optax transformation, typically `eqx_offload.offloaded(...)` with
        `memory_kind="pinned_host"` (the only host memory reachable while tracing), or
        what `eqx_offload.host_weights_optimizer` or `eqx_offload.master_weights`
        returns (the state their `init` gives: of `master_weights`, the second element),
        or what `eqx_offload.update_in_backward` returns (the `BackwardState` its
        `init` gives).
    - `params`: the parameters, as arrays or as `jax.ShapeDtypeStruct`s with shardings
        (so that neither the model nor the state needs to exist before the restore);
        for `host_weights_optimizer`, `master_weights` and `update_in_backward`, the
        model (its compute model, for `master_weights`).

    **Returns:**

    A pytree like `optimizer.init(params)`, with `jax.ShapeDtypeStruct` leaves.

    !!! Example

        ```python
        import jax.numpy as jnp
        import optax
        import eqx_offload

        params = {"w": jnp.ones((4, 4))}
        opt = eqx_offload.offloaded(optax.adamw(1e-3))
        target = eqx_offload.checkpoint.abstract_init(opt, params)
        assert target.inner_state[0].nu["w"].sharding.memory_kind == "pinned_host"
        assert target.inner_state[0].count.sharding.memory_kind == "device"
        ```
    """
    if isinstance(optimizer, BackwardUpdate):  # (its `init` gives `(model, state)`)
        target = filter_eval_shape(optimizer.init, params)[1]
    elif isinstance(optimizer, (HostWeightsOptimizer, MasterWeights)):
        # Their state is their transformation's, of the model's array leaves.
        target = abstract_state(optimizer.transformation, eqx.filter(params, is_arraylike))
    else:
        target = abstract_state(as_transformation(optimizer, "abstract_init(optimizer=...)"),
                                params)
    check_tree_fits_host_pool(jtu.tree_leaves(target, is_leaf=is_abstract), "abstract_init(...)")
    return target


def deserialise_filter_spec(f: BinaryIO, x: Any) -> Any:
    """A `filter_spec` for `eqx.tree_deserialise_leaves` that restores every array where
    the `like` leaf says: its sharding and memory kind.

    `eqx.default_deserialise_filter_spec` loads each array whole onto the default device,
    so an offloaded state comes back in device memory (and unsharded). With this filter
    spec, an array leaf of `like` (a `jax.Array`, or a `jax.ShapeDtypeStruct` with a
    sharding, e.g. from `abstract_init` or `restore_target`) is read into NumPy and each
    of its shards goes straight to its device's memory of that kind. Other leaves are
    handled by `eqx.default_deserialise_filter_spec`.

    **Arguments:**

    - `f`: the open file, positioned at the leaf (Equinox passes it).
    - `x`: the leaf of `like`.

    **Returns:**

    The restored leaf.

    **Raises:**

    `CheckpointError` if the stored array's shape or dtype differs from `x`'s.

    !!! Example

        ```python
        import tempfile
        import equinox as eqx
        import jax.numpy as jnp
        import optax
        import eqx_offload

        params = {"w": jnp.ones((4, 4))}
        opt = eqx_offload.offloaded(optax.adam(1e-3))
        path = tempfile.mkdtemp() + "/state.eqx"
        eqx.tree_serialise_leaves(path, opt.init(params))
        state = eqx.tree_deserialise_leaves(
            path, eqx_offload.checkpoint.abstract_init(opt, params),
            filter_spec=eqx_offload.checkpoint.deserialise_filter_spec,
        )
        assert state.inner_state[0].mu["w"].sharding.memory_kind == "pinned_host"
        ```
    """
    if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return eqx.default_deserialise_filter_spec(f, x)
    value = np.load(f)
    dtype = np.dtype(x.dtype)
    if value.dtype != dtype and value.dtype.kind == "V" and value.dtype.itemsize == dtype.itemsize:
        value = value.view(dtype)  # bfloat16 and friends are saved as raw bytes
    if value.shape != tuple(x.shape) or value.dtype != dtype:
        # (Equinox wraps this in its `TreePathError`; `tree_deserialise_leaves` does not.)
        raise checkpoint_leaf_error("deserialise_filter_spec", "(its path is in Equinox's error)",
                                    f"{value.dtype}{list(value.shape)}", f"{dtype}{list(x.shape)}")
    # One `device_put` of the NumPy value: each shard goes from it straight to its
    # device's memory of the sharding's kind.
    return jax.device_put(value, _sharding_of(x))


def tree_deserialise_leaves(path_or_file: Any, like: _T,
                            filter_spec: Callable[[BinaryIO, Any], Any] = deserialise_filter_spec,
                            is_leaf: Optional[Callable[[Any], bool]] = None) -> _T:
    """`eqx.tree_deserialise_leaves` with `deserialise_filter_spec`: every array restored
    where `like` says (its sharding and memory kind), and a `CheckpointError` for a leaf
    that does not fit, naming its path. (Equinox raises a filter spec's error as the
    cause of its own `TreePathError`, which `except eqx_offload.errors.CheckpointError` misses.)

    **Arguments:**

    - `path_or_file`, `like`, `is_leaf`: as for `eqx.tree_deserialise_leaves`.
    - `filter_spec`: default `eqx_offload.checkpoint.deserialise_filter_spec`.

    **Returns:**

    The restored tree, of `like`'s structure.

    **Raises:**

    `CheckpointError` if a stored array's shape or dtype differs from its `like` leaf's.

    !!! Example

        ```python
        import tempfile
        import equinox as eqx
        import jax.numpy as jnp
        import optax
        import eqx_offload

        opt = eqx_offload.offloaded(optax.adam(1e-3))
        path = tempfile.mkdtemp() + "/state.eqx"
        eqx.tree_serialise_leaves(path, opt.init({"w": jnp.ones((4, 4))}))
        try:
            eqx_offload.checkpoint.tree_deserialise_leaves(
                path, eqx_offload.checkpoint.abstract_init(opt, {"w": jnp.ones((4, 5))}))
        except eqx_offload.errors.CheckpointError as error:
            assert "leaf .inner_state[0].mu['w']" in str(error)
        ```
    """
    try:
        restored: _T = eqx.tree_deserialise_leaves(path_or_file, like, filter_spec=filter_spec,
                                                   is_leaf=is_leaf)
    except RuntimeError as error:  # Equinox's `TreePathError`
        cause = error.__cause__
        while cause is not None and not isinstance(cause, CheckpointError):
            cause = cause.__cause__
        if cause is None:
            raise
        fix, where, link = str(cause).split("\n", 2)
        detail = where.split(": ", 2)[-1]
        leaf = jtu.keystr(tuple(getattr(error, "path", ()))) or "(the tree itself)"
        raise CheckpointError(f"{fix}\ntree_deserialise_leaves: leaf {leaf}: {detail}\n"
                              f"{link}") from error
    return restored

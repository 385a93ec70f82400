"""`to_host` and `to_device`: one `jax.device_put` for the selected array leaves."""

from typing import Any, Optional, TypeVar, Union

import jax
import jax.tree_util as jtu

from ._errors import TracedMoveError
from ._memory import (
    check_devices_offer,
    check_host_kind,
    default_device,
    default_kind,
)
from ._types import HostMemoryKind, Where
from ._where import is_traced, leaf_mask, path_to_str


_T = TypeVar("_T")

# A sharding (eagerly) or a `jax.memory.Space` (traced). The latter is an attribute of
# a `SimpleNamespace` in JAX, invisible to type checkers, hence the `Any`.
Destination = Union[jax.sharding.Sharding, Any]


def _traced_error(memory_kind: str, argument: str, path: str) -> TracedMoveError:
    return TracedMoveError(
        f"{argument}={memory_kind!r} cannot be reached inside `jax.jit` (leaf "
        f"{path or '<root>'} is inside a trace): JAX's traced `device_put` only targets "
        "`jax.memory.Space.Host`, which is 'pinned_host'. Use "
        "memory_kind='pinned_host' under `jit`, or call this eagerly."
    )


def _destination(
    leaf: Any, memory_kind: Optional[str], argument: str, path: str
) -> Optional[Destination]:
    """Where `leaf` goes, or `None` if it is there already.

    `memory_kind=None` means the device's default memory (`to_device`)."""
    if is_traced(leaf):
        space = jax.typeof(leaf).memory_space
        if memory_kind is None:
            return None if space == jax.memory.Space.Device else jax.memory.Space.Device
        if memory_kind == "pinned_host":
            return None if space == jax.memory.Space.Host else jax.memory.Space.Host
        raise _traced_error(memory_kind, argument, path)
    if isinstance(leaf, jax.Array):
        sharding = leaf.sharding
        devices = sharding.addressable_devices
    else:  # a NumPy array: it goes where JAX would put it
        device = default_device()
        sharding = jax.sharding.SingleDeviceSharding(device)
        devices = {device}
    target = memory_kind if memory_kind is not None else default_kind(next(iter(devices)))
    check_devices_offer(devices, target, argument, path)
    if isinstance(leaf, jax.Array) and sharding.memory_kind == target:
        return None
    return sharding.with_memory_kind(target)


def move(tree: _T, where: Where, memory_kind: Optional[str], argument: str) -> _T:
    """Move the array leaves of `tree` selected by `where` to `memory_kind` (`None`: the
    device's default memory) with one `jax.device_put`; return everything else as is."""
    keyed_leaves, treedef = jtu.tree_flatten_with_path(tree)
    mask = leaf_mask(tree, where)
    leaves = [leaf for _, leaf in keyed_leaves]
    indices, paths, sources, destinations = [], [], [], []
    for i, ((path, leaf), selected) in enumerate(zip(keyed_leaves, mask)):
        if not selected:
            continue
        destination = _destination(leaf, memory_kind, argument, path_to_str(path))
        if destination is not None:
            indices.append(i)
            paths.append(path)
            sources.append(leaf)
            destinations.append(destination)
    if sources:
        space = jax.memory.Space.Device if memory_kind is None else jax.memory.Space.Host
        for i, key_path, moved in zip(indices, paths, jax.device_put(sources, destinations)):
            # A concrete array moved inside a trace (a constant closed over by a jitted
            # function) comes back traced; JAX drops a memory kind it cannot express
            # there ('unpinned_host') without a word, so check.
            if is_traced(moved) and jax.typeof(moved).memory_space != space:
                raise _traced_error(str(memory_kind), argument, path_to_str(key_path))
            leaves[i] = moved
    out: _T = jtu.tree_unflatten(treedef, leaves)
    return out


def to_host(
    tree: _T, where: Where = True, *, memory_kind: HostMemoryKind = "pinned_host"
) -> _T:
    """Moves the selected array leaves of a pytree to host memory.

    Works on any pytree (dicts, lists, tuples, `NamedTuple` optimizer states,
    `eqx.Module`s), eagerly and under `jax.jit`. Non-array leaves and unselected arrays
    are returned as they are; a leaf already in `memory_kind` is not copied. A sharded
    leaf keeps its mesh and `PartitionSpec`: only its memory kind changes.

    **Arguments:**

    - `tree`: any pytree.
    - `where`: which array leaves to move: a bool, a callable on a leaf (e.g.
        `eqx_offload.pattern(".*/mu/.*")`, `eqx_offload.min_bytes(1 << 20)`), or a
        pytree prefix of `tree` with those at its leaves. Default: every array.
    - `memory_kind`: `"pinned_host"` (default) or `"unpinned_host"`. Under `jax.jit`
        only `"pinned_host"` can be reached.

    **Returns:**

    A pytree of the same structure.

    **Raises:**

    `MemoryKindError` if the device lacks `memory_kind`; `WhereError` for a bad `where`;
    `TracedMoveError` for `"unpinned_host"` under `jit`.

    !!! Example

        ```python
        import jax.numpy as jnp
        import optax
        import eqx_offload

        params = {"w": jnp.ones((4, 4))}
        state = optax.adam(1e-3).init(params)
        state = eqx_offload.to_host(state)
        assert state[0].mu["w"].sharding.memory_kind == "pinned_host"
        ```
    """
    check_host_kind(memory_kind, "memory_kind")
    return move(tree, where, memory_kind, "memory_kind")


def to_device(tree: _T, where: Where = True) -> _T:
    """Moves the selected array leaves of a pytree to the device's default memory.

    The inverse of `to_host`: `to_device(to_host(tree))` equals `tree` leaf by leaf.

    **Arguments:**

    - `tree`: any pytree.
    - `where`: which array leaves to move (see `to_host`). Default: every array.

    **Returns:**

    A pytree of the same structure.
    """
    return move(tree, where, None, "to_device")

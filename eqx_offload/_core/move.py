"""The one mover, `put` (one `jax.device_put` for a flat list of leaves and their
targets, each leaf's from `destination`), and the public movers on it: `to_host`,
`to_device`, `filter_shard`. Every
module that moves arrays between memories goes through `put` (the layout's `fetch` and
`store`, the streamed and host-compute updates through `move`)."""

import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, TypeVar, Union

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.core import Tracer

from .compat import device_put, HOST_OUTPUT_COPY_FAILS, single_device_sharding
from .errors import nothing_to_move_message, OffloadError, OffloadWarning, OptionError
from .errors import TracedMoveError, TreeError
from .leaves import is_traced, path_to_str, shown
from .memory import check_devices_offer, check_host_kind, default_device, HOST_MEMORY_KINDS
from .placement import default_kind, is_host, memory_kind_of
from .types import HostMemoryKind, Where
from .where import leaf_mask, warn_if_selects_nothing


_T = TypeVar("_T")
DEVICE = jax.memory.Space.Device


# A sharding (eagerly) or a `jax.memory.Space` (traced). The latter is an attribute of
# a `SimpleNamespace` in JAX, invisible to type checkers, hence the `Any`.
Destination = Union[jax.sharding.Sharding, Any]


def traced_move_error(memory_kind: str, argument: str, path: str) -> TracedMoveError:
    return TracedMoveError(
        f"{argument}={memory_kind!r} cannot be reached inside `jax.jit` (leaf "
        f"{shown(path)} is inside a trace): JAX's traced `device_put` only targets "
        "`jax.memory.Space.Host`, which is 'pinned_host'. Use "
        "memory_kind='pinned_host' under `jit`, or call this eagerly."
    )


def space_of(memory_kind: Optional[str]) -> Any:
    """The `jax.memory.Space` a traced move to `memory_kind` targets (`None`: the
    device's default memory)."""
    return jax.memory.Space.Device if memory_kind is None else jax.memory.Space.Host


def destination(
    leaf: Any, memory_kind: Optional[str], argument: str, path: str
) -> Optional[Destination]:
    """Where a move sends `leaf`, or `None` if it is there already.

    `memory_kind=None` means the device's default memory (`to_device`). A concrete leaf
    keeps its devices and layout (`sharding.with_memory_kind`); a NumPy array goes where
    JAX would put it; a traced leaf goes to a `jax.memory.Space`."""
    if isinstance(leaf, Tracer):
        space = jax.typeof(leaf).memory_space
        if memory_kind is not None and memory_kind != "pinned_host":
            raise traced_move_error(memory_kind, argument, path)
        target = space_of(memory_kind)
        return None if space == target else target
    if isinstance(leaf, jax.Array):
        sharding = leaf.sharding
        devices = sharding.addressable_devices
    else:  # a NumPy array: it goes where JAX would put it
        device = default_device()
        sharding = single_device_sharding(device)
        devices = {device}
    target_kind = memory_kind if memory_kind is not None else default_kind(next(iter(devices)))
    check_devices_offer(devices, target_kind, argument, path)
    if isinstance(leaf, jax.Array) and sharding.memory_kind == target_kind:
        return None
    return sharding.with_memory_kind(target_kind)


def put(leaves: Sequence[Any], targets: Sequence[Optional[Destination]],
        memory_kind: Optional[str] = None, argument: Optional[str] = None,
        path_of: Callable[[int], str] = str) -> list[Any]:
    """The one mover: each leaf whose target (a sharding; traced, a `jax.memory.Space`)
    is not `None` moved there, all in one `jax.device_put`. With `argument` (for the
    error): a leaf that comes back traced outside `memory_kind`'s space is an error
    naming `path_of(i)` (JAX drops 'unpinned_host' in a trace without a word)."""
    out = list(leaves)
    indices = [i for i, target in enumerate(targets) if target is not None]
    if not indices:
        return out
    chosen = [leaves[i] for i in indices]
    # The source of a traced device leaf: JAX moves a cotangent back to the source (a
    # host leaf's it finds by itself; its zero tangent JAX 0.10 types for the device).
    sources = [DEVICE if isinstance(x, Tracer) and jax.typeof(x).memory_space == DEVICE
               else None for x in chosen]
    # (`jax.device_put` itself where JAX copies every array: `compat.HOST_OUTPUT_COPY_FAILS`.)
    moved = (device_put if HOST_OUTPUT_COPY_FAILS else jax.device_put)(
        chosen, [targets[i] for i in indices], src=sources)
    for i, leaf in zip(indices, moved, strict=True):
        if (argument is not None and isinstance(leaf, Tracer)  # (`is_traced`, inlined:
                and jax.typeof(leaf).memory_space != space_of(memory_kind)):  # the eager path)
            raise traced_move_error(str(memory_kind), argument, path_of(i))
        out[i] = leaf
    return out


def put_selected(leaves: Sequence[Any], selected: Sequence[bool], memory_kind: Optional[str],
                 argument: str, path_of: Callable[[int], str],
                 cache: Optional[dict[Any, Any]] = None) -> list[Any]:
    """`put` of the array leaves `selected` picks to `memory_kind`, each sent where
    `destination` says, its error naming the leaf's path, `path_of(i)` (a walk of the
    tree: for an error only). `cache` keeps the destinations of concrete leaves by
    (sharding, memory kind), each checked once."""
    targets: list[Optional[Destination]] = []
    for i, (leaf, chosen) in enumerate(zip(leaves, selected, strict=True)):
        if not chosen or not eqx.is_array(leaf):
            targets.append(None)
        elif cache is None or not isinstance(leaf, jax.Array) or isinstance(leaf, Tracer):
            targets.append(_destination_of(leaf, memory_kind, argument, path_of, i))
        else:
            key = (leaf.sharding, memory_kind)
            if key not in cache:
                if len(cache) >= 256:
                    cache.clear()
                cache[key] = _destination_of(leaf, memory_kind, argument, path_of, i)
            targets.append(cache[key])
    return put(leaves, targets, memory_kind, argument, path_of)


def _destination_of(leaf: Any, memory_kind: Optional[str], argument: str,
                    path_of: Callable[[int], str], i: int) -> Optional[Destination]:
    """`destination` of leaf `i`, its error naming the leaf's path (walked only then)."""
    try:
        return destination(leaf, memory_kind, argument, "")
    except OffloadError:  # again, naming the leaf
        return destination(leaf, memory_kind, argument, path_of(i))


def place_like(tree: _T, like: Any) -> _T:
    """Each array leaf of `tree` moved to the host memory kind of the leaf of `like` at
    the same place, if that one is in host memory (one `put`)."""
    leaves, treedef = jtu.tree_flatten(tree)
    homes = [memory_kind_of(x) if is_host(x) else None for x in jtu.tree_leaves(like)]
    leaves = put(leaves, [destination(x, h, "memory_kind", str(i))
                          if h is not None and eqx.is_array(x) else None
                          for i, (x, h) in enumerate(zip(leaves, homes, strict=True))])
    out: _T = jtu.tree_unflatten(treedef, leaves)
    return out


def move(tree: _T, where: Where, memory_kind: Optional[str], argument: str,
         caller: Optional[str] = None) -> _T:
    """Move the array leaves of `tree` selected by `where` to `memory_kind` (`None`: the
    device's default memory) with one `jax.device_put`; return everything else as is.
    `caller`: the public function a user called (`"to_host"`), which warns where there
    is nothing to move or `where` selects nothing."""
    if isinstance(tree, Iterator):
        raise TreeError(
            f"tree=<{type(tree).__name__}>: an iterator is not a pytree; JAX "
            "treats as one opaque leaf, so nothing in it would move. Pass a pytree "
            "(e.g. `list(...)` or `tuple(...)` of it)."
        )
    mask = leaf_mask(tree, where)
    if caller is not None and not any(mask):  # (a selected leaf is an array: it moves)
        _warn_if_nothing_moves(tree, where, mask, caller)
    return _moved(tree, mask, memory_kind, argument)


def fetch(tree: _T) -> _T:
    """Every array leaf of `tree` in the device's default memory (those there already
    are not copied): the library's own `to_device`."""
    return _moved(tree, None, None, "to_device")


def send_to_host(tree: _T) -> _T:
    """Every array leaf of `tree` in pinned host memory (those there already are not
    copied): the library's own `to_host`, with no filter to resolve."""
    return _moved(tree, None, "pinned_host", "memory_kind")


def _moved(tree: _T, mask: Optional[Sequence[bool]], memory_kind: Optional[str],
           argument: str) -> _T:
    """The array leaves of `tree` that `mask` selects (default all) moved to
    `memory_kind`, in one `put`."""
    leaves, treedef = jtu.tree_flatten(tree)
    path_of = functools.partial(_path_of, tree)
    out: _T = jtu.tree_unflatten(treedef, put_selected(
        leaves, mask or [True] * len(leaves), memory_kind, argument, path_of))
    return out


def _path_of(tree: Any, i: int) -> str:
    """The path of leaf `i` of `tree` (a walk of the tree: for an error only)."""
    return path_to_str(jtu.tree_flatten_with_path(tree)[0][i][0])


def _warn_if_nothing_moves(tree: Any, where: Where, mask: list[bool], caller: str) -> None:
    """`OffloadWarning`s for a call that is valid but moves nothing it was surely meant
    to: leaves none of which is an array (`to_host([1, 2, 3])`, whose leaves JAX would
    make arrays of), or a `where` that selects none of the arrays. Converting instead
    would break the promise that non-array leaves come back as they are (the Python
    floats and functions of an `eqx.Module`)."""
    leaves = jtu.tree_leaves(tree)
    if leaves and not any(map(eqx.is_array, leaves)):
        warnings.warn(nothing_to_move_message(caller, len(leaves)), OffloadWarning,
                      stacklevel=4)
        return
    warn_if_selects_nothing(tree, where, mask, "where", stacklevel=5)


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
    `TracedMoveError` for `"unpinned_host"` under `jit`; `TreeError` for an iterator
    (such as a generator) in place of a pytree. An `OffloadWarning` where nothing
    moves that surely was meant to: no leaf is an array (`to_host([1, 2, 3])`: make
    arrays first with `jnp.asarray`), or `where` selects none of the arrays.

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
    if memory_kind not in HOST_MEMORY_KINDS:  # (the check, where it fails)
        check_host_kind(memory_kind, "memory_kind")
    return move(tree, where, memory_kind, "memory_kind", "to_host")


def to_device(tree: _T, where: Where = True) -> _T:
    """Moves the selected array leaves of a pytree to the device's default memory.

    The inverse of `to_host`: `to_device(to_host(tree))` equals `tree` leaf by leaf. It
    warns as `to_host` does where nothing moves that surely was meant to.

    **Arguments:**

    - `tree`: any pytree.
    - `where`: which array leaves to move (see `to_host`). Default: every array.

    **Returns:**

    A pytree of the same structure.
    """
    return move(tree, where, None, "to_device", "to_device")


def filter_shard(tree: _T, sharding: jax.sharding.Sharding) -> _T:
    """`eqx.filter_shard` that keeps every array leaf in its memory.

    Each array leaf gets `sharding`'s devices and layout in the memory kind it already
    has: an offloaded state stays in host memory, on the new devices. Eagerly this is
    a `jax.device_put`, which (unlike `eqx.filter_shard` outside `jit`) also moves a
    committed array to other devices; JAX commits every host array, so an offloaded
    state made on one device is committed to it. Under `jit` it is
    `jax.lax.with_sharding_constraint`, as `eqx.filter_shard` (which keeps memory kinds
    there too).

    **Arguments:**

    - `tree`: any pytree; non-array leaves are returned as they are.
    - `sharding`: a `jax.sharding.Sharding` (its memory kind is ignored).

    **Returns:**

    A pytree of the same structure.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import optax
        from jax.sharding import NamedSharding, PartitionSpec as P
        import eqx_offload

        mesh = jax.make_mesh((len(jax.devices()),), ("data",))
        opt = eqx_offload.offloaded(optax.adam(1e-3))
        state = opt.init({"w": jnp.ones((4, 4))})  # on one device
        state = eqx_offload.filter_shard(state, NamedSharding(mesh, P()))
        assert state.inner_state[0].mu["w"].sharding.mesh == mesh
        assert state.inner_state[0].mu["w"].sharding.memory_kind == "pinned_host"
        ```
    """
    if not isinstance(sharding, jax.sharding.Sharding):
        raise OptionError(
            f"filter_shard(sharding={sharding!r}): sharding must be a "
            "`jax.sharding.Sharding`, e.g. `NamedSharding(mesh, PartitionSpec())`."
        )
    leaves, treedef = jtu.tree_flatten(tree)
    targets = [sharding.with_memory_kind(memory_kind_of(x) or default_kind(
        next(iter(sharding.device_set)))) if eqx.is_array(x) else None for x in leaves]
    if any(map(is_traced, leaves)):
        moved = [x if s is None else jax.lax.with_sharding_constraint(x, s)
                 for x, s in zip(leaves, targets, strict=True)]
    else:
        moved = put(leaves, targets)
    out: _T = jtu.tree_unflatten(treedef, moved)
    return out

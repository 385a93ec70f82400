"""One call of a `filter_jit` function: its arguments, flattened once (by
`jit._flatten_call`), how to rebuild its result, and the warning for a Python number
whose change compiles the function again."""

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.tree_util as jtu

from .._core.errors import OffloadWarning
from .donation import _Donation


@dataclasses.dataclass
class _Call:
    """The arguments of one call, flattened once."""

    all_leaves: list[Any]
    treedef: Any
    is_array: tuple[bool, ...]
    leaves: list[Any]  # the array leaves, in order: what the executable takes
    donated: tuple[int, ...]  # indices into `leaves`
    retyped: dict[int, jax.Array]  # index into `leaves` -> the mistyped original
    in_shardings: list[jax.sharding.Sharding]
    key: tuple[Any, ...]  # what selects the executable
    shared: dict[int, jax.Array] = dataclasses.field(default_factory=dict)  # see `_unshare`


@dataclasses.dataclass
class _Output:
    """How to rebuild a result: the flat output with `None` where the executable's
    arrays go, in the order of `positions` (and whether the program streams an
    offloaded state, which selects `default_compiler_options`)."""

    treedef: Any
    leaves: list[Any]
    positions: list[int]
    streamed: bool = False
    prefetched: bool = False
    whole: bool = False

    def rebuild(self, arrays: Sequence[Any]) -> Any:
        leaves = list(self.leaves)
        for i, x in zip(self.positions, arrays, strict=True):
            leaves[i] = x
        return jtu.tree_unflatten(self.treedef, leaves)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, complex)) and not isinstance(x, bool)


def _changed_number(cached: Any, call: _Call) -> Optional[tuple[int, Any, Any]]:
    """Where `call` differs from a configuration in `cached` (keys of `_flatten_call`)
    only in the values of Python numbers (static here, traced by `jax.jit`): the
    index into `call.all_leaves` of the first, its old value and its new one."""
    static_at = [i for i, a in enumerate(call.is_array) if not a]
    for key in cached:
        if key[:3] != call.key[:3] or key[4] != call.key[4]:
            continue
        changed = [j for j, (old, new) in enumerate(zip(key[3], call.key[3], strict=True))
                   if old != new]
        if changed and all(_is_number(key[3][j][1]) and _is_number(call.key[3][j][1])
                           for j in changed):
            return static_at[changed[0]], key[3][changed[0]][1], call.key[3][changed[0]][1]
    return None


def _warn_changed_number(cached: Any, call: _Call, donate: _Donation, name: str) -> bool:
    """Warn (and return `True`) where `call` compiles again only because a Python
    number changed: a Flax linen `TrainState`'s `step=0` compiles at every step."""
    found = _changed_number(cached, call)
    if found is None:
        return False
    i, old, new = found
    arguments = jtu.tree_unflatten(call.treedef, call.all_leaves)
    path = jtu.tree_flatten_with_path(arguments)[0][i][0]
    if getattr(path[0], "idx", 0) == 0:
        parameter = donate.argument_name(getattr(path[1], "idx", 0))
        where = f"`{parameter}`" if parameter else f"args[{getattr(path[1], 'idx', 0)}]"
    else:
        where = f"`{getattr(path[1], 'key', path[1])}`"
    leaf = jtu.keystr(tuple(path[2:])) or "(the argument itself)"
    warnings.warn(
        f"filter_jit({name}): pass this number as an array (`jnp.asarray(...)`), or use "
        f"`eqx_offload.jit`, which traces Python numbers as `jax.jit` does: {where}, leaf "
        f"{leaf} is a Python {type(new).__name__}, static here, and its change ({old!r} -> "
        f"{new!r}) compiled the function again. (Shown once; see \"Getting started\".)",
        OffloadWarning, stacklevel=3)
    return True

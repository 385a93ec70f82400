"""One call of a `filter_jit` function: its arguments, flattened once
(`flatten_call`), the `Signature` that selects its executable, how to rebuild its
result, and the warning for a Python number whose change compiles the function again."""

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.core import Tracer

from .._core.errors import OffloadWarning
from .._core.placement import input_shardings, is_mistyped_host, retype_host
from .donation import _check_not_deleted, _Donation, _unshare


class Signature(NamedTuple):
    """What selects a `filter_jit` executable (its cache key): a frozen, hashable record
    of one call's configuration."""

    treedef: Any  # of `(args, kwargs)`
    is_array: tuple[bool, ...]  # per leaf: traced (an array) or static
    donation: Any  # the first argument's leaf count (a mode), or the donated indices (names)
    statics: tuple[tuple[type, Any], ...]  # the non-array leaves, by type and value
    arrays: tuple[tuple[Any, ...], ...]  # per array leaf: shape, dtype, weak type, sharding


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
    key: Signature  # what selects the executable
    shared: dict[int, jax.Array] = dataclasses.field(default_factory=dict)  # see `_unshare`


def traced(flat: tuple[list[Any], Any]) -> bool:
    """Whether a leaf of a flattened call is traced: the call is inside an enclosing
    `jit`, `grad` or `vmap`."""
    return any(isinstance(x, Tracer) for x in flat[0])


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any], donate: _Donation,
                  abstract: bool = False, name: str = "fun",
                  flat: Optional[tuple[list[Any], Any]] = None) -> _Call:
    """The call's arguments, flattened once (or `flat`, their `jtu.tree_flatten`).
    With `abstract` (`gpu_plan`), a `jax.ShapeDtypeStruct` leaf stands for an array
    too: the step is traced and compiled for it, and nothing is allocated (a caller
    checks it has a sharding)."""
    all_leaves, treedef = flat if flat is not None else jtu.tree_flatten((args, kwargs))
    is_array = tuple(
        eqx.is_array(x) or (abstract and isinstance(x, jax.ShapeDtypeStruct)) for x in all_leaves)
    # Which argument each leaf is of matters only where the arguments are donated
    # differently: for a mode, the first argument's leaves (`n_first`, a part of the
    # key); by name, every argument's (counted only then: this runs at every call).
    n_first = 0
    if donate.names is None:
        if donate.first != donate.rest:
            first_def: Any = jtu.tree_structure(args[:1])  # `PyTreeDef` is untyped for mypy
            n_first = first_def.num_leaves
        flags = [donate.first if i < n_first else donate.rest for i in range(len(all_leaves))]
    else:
        arguments = list(args) + [kwargs[k] for k in sorted(kwargs)]
        sizes: list[int] = [len(jtu.tree_leaves(a)) for a in arguments]
        flags = [d for d, n in zip(donate.per_argument(args, kwargs), sizes, strict=True)
                 for _ in range(n)]
    if not abstract:
        _check_not_deleted(all_leaves, args, kwargs, donate, name)
    leaves: list[Any] = []
    donated: list[int] = []
    for x, a, d in zip(all_leaves, is_array, flags, strict=True):
        if a:
            if d:
                donated.append(len(leaves))
            leaves.append(x)
    shared = _unshare(leaves, donated) if donated else {}
    retyped = {i: x for i, x in enumerate(leaves) if is_mistyped_host(x)}
    for i, x in retyped.items():
        leaves[i] = retype_host(x)
    shardings = input_shardings(leaves)
    key = Signature(
        treedef,
        is_array,
        n_first if donate.names is None else tuple(donated),
        # The non-array leaves, by value and type (as `eqx.filter_jit`, they must be
        # hashable: `1` and `1.0` or `True` must not share an executable).
        tuple((type(x), x) for x, a in zip(all_leaves, is_array, strict=True) if not a),
        tuple(
            (x.shape, x.dtype, getattr(x, "weak_type", False), s)
            for x, s in zip(leaves, shardings, strict=True)
        ),
    )
    return _Call(all_leaves, treedef, is_array, leaves, tuple(donated), retyped, shardings,
                 key, shared)


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
    """Where `call` differs from a configuration in `cached` (`Signature`s) only in the
    values of Python numbers (static here, traced by `jax.jit`): the index into
    `call.all_leaves` of the first, its old value and its new one."""
    static_at = [i for i, a in enumerate(call.is_array) if not a]
    new = call.key
    for key in cached:
        if key._replace(statics=new.statics) != new:
            continue
        changed = [j for j, (a, b) in enumerate(zip(key.statics, new.statics, strict=True))
                   if a != b]
        if changed and all(_is_number(key.statics[j][1]) and _is_number(new.statics[j][1])
                           for j in changed):
            j = changed[0]
            return static_at[j], key.statics[j][1], new.statics[j][1]
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

"""One call of a `filter_jit` function, flattened once (`flatten_call`) into the record
the rest of its path reads (`Call`): its array leaves and their shardings, what it
donates (each donated leaf a buffer of its own), and the `Signature` that selects its
executable. Also what a call's arguments alone can show: an array an earlier donating
call consumed (`DonationError`), and a Python number whose change compiles the function
again (a warning)."""

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._core.compat import copy, is_single_device_sharding
from .._core.errors import deleted_array_error, OffloadWarning
from .._core.leaves import call_argument
from .._core.placement import input_shardings, retype_hosts
from .donation import Donation


FUN = "<fun>"
"""The keyword under which `filter_jit` passes the arrays of the function it wraps (an
Equinox module as the function) to its own trace, as arguments rather than constants."""


class Signature(NamedTuple):
    """What selects a `filter_jit` executable (its cache key): a frozen, hashable record
    of one call's configuration."""

    treedef: Any  # of `(args, kwargs)`
    is_array: tuple[bool, ...]  # per leaf: traced (an array) or static
    donation: Any  # the first argument's leaf count (a mode), or the donated indices (names)
    statics: tuple[tuple[type, Any], ...]  # the non-array leaves, by type and value
    arrays: tuple[tuple[Any, ...], ...]  # per array leaf: shape, dtype, weak type, sharding


@dataclasses.dataclass
class Call:
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


def _argument_name(donate: Donation, i: int) -> Optional[str]:
    """The parameter that positional argument `i` binds to, if known."""
    return donate.positional[i] if i < len(donate.positional) else donate.varargs


def _donated_leaves(donate: Donation, args: tuple[Any, ...], kwargs: dict[str, Any],
                    n_leaves: int) -> tuple[int, list[bool]]:
    """Whether each leaf of `(args, kwargs)` is donated, and for a mode that donates the
    first argument otherwise than the rest, that argument's leaf count (a part of the
    key). By name, every argument's leaves are counted (only then: this runs at every
    call), `args` then `kwargs` by sorted key, the order of `jax.tree.leaves`."""
    if donate.names is None:
        n_first = 0
        if donate.first != donate.rest:
            first_def: Any = jtu.tree_structure(args[:1])  # `PyTreeDef` is untyped for mypy
            n_first = first_def.num_leaves
        return n_first, [donate.first if i < n_first else donate.rest for i in range(n_leaves)]
    per_argument = ([_argument_name(donate, i) in donate.names for i in range(len(args))]
                    + [k in donate.names for k in sorted(kwargs)])
    arguments = list(args) + [kwargs[k] for k in sorted(kwargs)]
    return 0, [d for d, a in zip(per_argument, arguments, strict=True)
               for _ in range(len(jtu.tree_leaves(a)))]


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any], donate: Donation,
                 abstract: bool = False, name: str = "fun",
                 flat: Optional[tuple[list[Any], Any]] = None) -> Call:
    """The call's arguments, flattened once (or `flat`, their `jtu.tree_flatten`).
    With `abstract` (`lower`, `lower_for`), a `jax.ShapeDtypeStruct` leaf stands for an
    array too: the step is traced and compiled for it, and nothing is allocated. The
    leaves of keyword argument `FUN` (the jitted function's own arrays,
    `filter_jit(model)`) are traced and never donated."""
    all_leaves, treedef = flat if flat is not None else jtu.tree_flatten((args, kwargs))
    is_array = tuple(
        eqx.is_array(x) or (abstract and isinstance(x, jax.ShapeDtypeStruct)) for x in all_leaves)
    n_first, flags = _donated_leaves(donate, args, kwargs, len(all_leaves))
    if FUN in kwargs:  # (the first keyword argument: "<" sorts before any identifier)
        start = len(jtu.tree_leaves(args))
        for i in range(start, start + len(jtu.tree_leaves(kwargs[FUN]))):
            flags[i] = False
    _check_not_deleted(all_leaves, args, kwargs, donate, name)
    leaves = [x for x, a in zip(all_leaves, is_array, strict=True) if a]
    donated = [i for i, d in enumerate(d for d, a in zip(flags, is_array, strict=True) if a) if d]
    shared = _unshare(leaves, donated) if donated else {}
    retyped = retype_hosts(leaves)
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
    return Call(all_leaves, treedef, is_array, leaves, tuple(donated), retyped, shardings,
                key, shared)


def over_one_device_meshes(tree: Any) -> Any:
    """`tree` with each `jax.ShapeDtypeStruct` whose sharding is a
    `SingleDeviceSharding` given the same device and memory kind as a `NamedSharding`
    over a one-device mesh: lowered for a TPU without one, libtpu's compile-only device
    types an argument of a `SingleDeviceSharding` in `pinned_host` as device memory,
    and over a mesh it keeps its memory kind (`plan` does the same:
    `tests/upstream/test_upstream_tpu_deviceless.py` pins it)."""
    def one(x: Any) -> Any:
        sharding: Any = getattr(x, "sharding", None)
        if not isinstance(x, jax.ShapeDtypeStruct) or not is_single_device_sharding(sharding):
            return x
        (device,) = sharding.device_set
        meshed = jax.sharding.NamedSharding(
            jax.sharding.Mesh([device], ("_",)), jax.sharding.PartitionSpec(),
            memory_kind=sharding.memory_kind)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=meshed,
                                    weak_type=x.weak_type)
    return jtu.tree_map(one, tree)


def _check_not_deleted(all_leaves: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                       donate: Donation, name: str) -> None:
    """A `DonationError` naming the argument and the leaf, where an array of the call
    was deleted (an earlier call that donated it consumed it): JAX would only say
    "Array has been deleted with shape=..."."""
    if not any(isinstance(x, jax.Array) and x.is_deleted() for x in all_leaves):
        return
    for path, x in jtu.tree_flatten_with_path((args, kwargs))[0]:
        if not (isinstance(x, jax.Array) and x.is_deleted()):
            continue
        argument, leaf = call_argument(path)
        if isinstance(argument, int):
            parameter = _argument_name(donate, argument)
            where = f"args[{argument}]" + (f" (`{parameter}`)" if parameter else "")
        else:
            where = f"`{argument}`"
        raise deleted_array_error(f"filter_jit({name})", where, leaf, f"{x.dtype}{list(x.shape)}")


def _unshare(leaves: list[Any], donated: Sequence[int]) -> dict[int, jax.Array]:
    """Give every donated leaf a buffer of its own: where one array stands at several
    leaves (Equinox's `eqx.nn.State(model)` shares arrays with the model; a tied
    embedding) and is donated at one of them, the other donated places get a copy
    (`leaves` is changed in place). Donating one buffer twice is what JAX refuses
    ("Attempt to donate the same buffer twice"); passing it donated once and undonated
    elsewhere would let XLA overwrite what the other input still reads. The original
    goes to the first donated place if every place is donated (so it is consumed, as
    donation promises), else it stays where it is not donated (the caller keeps it).
    Returns index -> original for the places that got a copy, which are consumed after
    the call. The executable is the same whatever the sharing: one compilation."""
    if len({id(x) for x in leaves}) == len(leaves):  # (the usual call: nothing shared)
        return {}
    places: dict[int, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array):
            places.setdefault(id(x), []).append(i)
    donated_set = set(donated)
    shared: dict[int, jax.Array] = {}
    for where in places.values():
        if len(where) < 2:
            continue
        donated_here = [i for i in where if i in donated_set]
        if not donated_here:
            continue
        keep = donated_here[0] if len(donated_here) == len(where) else None
        for i in donated_here:
            if i != keep:
                shared[i] = leaves[i]
                leaves[i] = copy(leaves[i])
    return shared


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, complex)) and not isinstance(x, bool)


def _changed_number(cached: Any, call: Call) -> Optional[tuple[int, Any, Any]]:
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


def warn_changed_number(cached: Any, call: Call, donate: Donation, name: str) -> bool:
    """Warn (and return `True`) where `call` compiles again only because a Python
    number changed: a Flax linen `TrainState`'s `step=0` compiles at every step."""
    found = _changed_number(cached, call)
    if found is None:
        return False
    i, old, new = found
    arguments = jtu.tree_unflatten(call.treedef, call.all_leaves)
    path = jtu.tree_flatten_with_path(arguments)[0][i][0]
    argument, leaf = call_argument(path)
    parameter = _argument_name(donate, argument) if isinstance(argument, int) else argument
    where = f"`{parameter}`" if parameter else f"args[{argument}]"
    warnings.warn(
        f"filter_jit({name}): pass this number as an array (`jnp.asarray(...)`), or use "
        f"`eqx_offload.jit`, which traces Python numbers as `jax.jit` does: {where}, leaf "
        f"{leaf} is a Python {type(new).__name__}, static here, and its change ({old!r} -> "
        f"{new!r}) compiled the function again. (Shown once; see \"Getting started\".)",
        OffloadWarning, stacklevel=3)
    return True

"""`filter_jit`'s donation: `donate=` checked (a mode, or names of the function's
parameters), what each argument donates, the error for an array an earlier donating call
consumed, and a buffer of its own for every donated leaf."""

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import jax.tree_util as jtu

from .._core.errors import deleted_array_error, OptionError


_DONATE_MODES: dict[str, tuple[bool, bool, bool]] = {
    # mode: (donate first argument, donate the rest, silence unusable-donation warnings)
    "all": (True, True, True),
    "all-except-first": (False, True, True),
    "warn": (True, True, False),
    "warn-except-first": (False, True, False),
    "none": (False, False, False),
}
_UNUSABLE_DONATION = "Some donated buffers were not usable"


@dataclasses.dataclass(frozen=True)
class _Donation:
    """What a `filter_jit` function donates: by mode (`donate="all"`, ...: the first
    argument and the rest), or by parameter name (`donate=("model", "opt_state")`)."""

    first: bool
    rest: bool
    silence: bool  # JAX's warning about donated buffers it could not reuse
    names: Optional[frozenset[str]] = None
    positional: tuple[str, ...] = ()  # `fun`'s positional parameters, in order
    varargs: Optional[str] = None  # its `*args`, if any

    def per_argument(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[bool]:
        """Whether each argument (of `args`, then `kwargs` by sorted key, the order of
        `jax.tree.leaves`) is donated by name (a mode needs no per-argument flags:
        `_flatten_call`)."""
        names = self.names or frozenset()
        return ([self.argument_name(i) in names for i in range(len(args))]
                + [k in names for k in sorted(kwargs)])

    def argument_name(self, i: int) -> Optional[str]:
        """The parameter that positional argument `i` binds to, if known."""
        return self.positional[i] if i < len(self.positional) else self.varargs


def _parameters(fun: Optional[Callable[..., Any]]
                ) -> tuple[tuple[str, ...], Optional[str], set[str], bool]:
    """`fun`'s positional parameters, its `*args` name, every name it accepts, and
    whether it takes `**kwargs` (nothing known where it has no signature)."""
    positional: list[str] = []
    varargs: Optional[str] = None
    accepted: set[str] = set()
    var_keyword = fun is None
    parameters: list[inspect.Parameter] = []
    try:
        if fun is not None:
            parameters = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):  # a builtin or a C callable: nothing known
        var_keyword = True
    for p in parameters:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            varargs = p.name
        elif p.kind is p.VAR_KEYWORD:
            var_keyword = True
            continue
        accepted.add(p.name)
    return tuple(positional), varargs, accepted, var_keyword


def _donation(donate: Any, fun: Optional[Callable[..., Any]]) -> _Donation:
    """`filter_jit`'s `donate=` checked: a mode, or names of `fun`'s parameters."""
    modes = ", ".join(repr(m) for m in _DONATE_MODES)
    positional, varargs, accepted, var_keyword = _parameters(fun)
    if isinstance(donate, str):
        if donate not in _DONATE_MODES:
            raise OptionError(
                f"filter_jit(donate={donate!r}): donate must be one of {modes}, or a tuple "
                "of the names of the parameters to donate."
            )
        return _Donation(*_DONATE_MODES[donate], None, positional, varargs)
    if not (isinstance(donate, (tuple, list, frozenset, set))
            and all(isinstance(n, str) for n in donate)):
        raise OptionError(
            f"filter_jit(donate={donate!r}): donate must be one of {modes}, or a tuple of "
            "the names of the parameters to donate (e.g. donate=(\"model\", \"opt_state\"))."
        )
    unknown = sorted(set(donate) - accepted)
    if unknown and not var_keyword:
        raise OptionError(
            f"filter_jit(donate={tuple(donate)!r}): {', '.join(map(repr, unknown))} "
            f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} of "
            f"{getattr(fun, '__qualname__', fun)!s}; its parameters are "
            f"{', '.join(map(repr, sorted(accepted))) or 'none'}."
        )
    return _Donation(True, True, True, frozenset(donate), positional, varargs)


def _check_not_deleted(all_leaves: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                       donate: _Donation, name: str) -> None:
    """A `DonationError` naming the argument and the leaf, where an array of the call
    was deleted (an earlier call that donated it consumed it): JAX would only say
    "Array has been deleted with shape=..."."""
    if not any(isinstance(x, jax.Array) and x.is_deleted() for x in all_leaves):
        return
    for path, x in jtu.tree_flatten_with_path((args, kwargs))[0]:
        if not (isinstance(x, jax.Array) and x.is_deleted()):
            continue
        kind, key, rest = path[0], path[1], path[2:]
        if getattr(kind, "idx", 0) == 0:  # args
            i = getattr(key, "idx", 0)
            parameter = donate.argument_name(i)
            where = f"args[{i}]" + (f" (`{parameter}`)" if parameter else "")
        else:
            where = f"`{getattr(key, 'key', key)}`"
        leaf = jtu.keystr(tuple(rest)) or "(the argument itself)"
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
                leaves[i] = jax.device_put(leaves[i], leaves[i].sharding, may_alias=False)
    return shared

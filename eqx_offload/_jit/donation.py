"""`filter_jit`'s `donate=`, checked once when the function is wrapped
(`parse_donate`: a mode, or names of the function's parameters) into the record each
call reads (`Donation`; `call.flatten_call` applies it to the call's leaves)."""

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Optional

from .._core.errors import OptionError


_DONATE_MODES: dict[str, tuple[bool, bool, bool]] = {
    # mode: (donate first argument, donate the rest, silence unusable-donation warnings)
    "all": (True, True, True),
    "all-except-first": (False, True, True),
    "warn": (True, True, False),
    "warn-except-first": (False, True, False),
    "none": (False, False, False),
}
UNUSABLE_DONATION = "Some donated buffers were not usable"
"""How JAX's warning about donated buffers it could not reuse starts (the `"all"` modes
silence it)."""


@dataclasses.dataclass(frozen=True)
class Donation:
    """What a `filter_jit` function donates: by mode (`donate="all"`, ...: the first
    argument and the rest), or by parameter name (`donate=("model", "opt_state")`)."""

    first: bool
    rest: bool
    silence: bool  # JAX's warning about donated buffers it could not reuse
    names: Optional[frozenset[str]] = None
    positional: tuple[str, ...] = ()  # `fun`'s positional parameters, in order
    varargs: Optional[str] = None  # its `*args`, if any


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


def parse_donate(donate: Any, fun: Optional[Callable[..., Any]]) -> Donation:
    """`filter_jit`'s `donate=` checked: a mode, or names of `fun`'s parameters."""
    modes = ", ".join(repr(m) for m in _DONATE_MODES)
    positional, varargs, accepted, var_keyword = _parameters(fun)
    if isinstance(donate, str):
        if donate not in _DONATE_MODES:
            raise OptionError(
                f"filter_jit(donate={donate!r}): donate must be one of {modes}, or a tuple "
                "of the names of the parameters to donate."
            )
        return Donation(*_DONATE_MODES[donate], None, positional, varargs)
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
    return Donation(True, True, True, frozenset(donate), positional, varargs)

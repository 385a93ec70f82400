"""Where the host-memory operand of a refused operation came from, for `filter_jit`'s
error: an argument of the step (a weight moved with `to_host`), or a value the step
made (the gradient of such a weight is in host memory too: JAX transposes the move
that fetched the weight into a move back to host).

JAX refuses an operation on a host and a device operand while tracing (`ValueError`,
`compat.memory_space_mismatch`), before any jaxpr exists. The operands are found in
the traceback's frames (their locals), and each traced value's origin is read from
the tracer (`compat.tracer_origin`); where it is unknown the error says what it said
before.
"""

import dataclasses
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Optional

import jax
import jax.tree_util as jtu
from jax.core import Tracer

from .._core.compat import tracer_origin


@dataclasses.dataclass(frozen=True)
class HostOperand:
    """A host-memory operand of the refused operation.

    **Fields:** `name` (how the innermost user frame calls it: `g`, `self.weight`; `""`
    where no local holds it), `argument` (the step's argument and leaf it is, e.g.
    `"args[0], leaf .blocks.weight"`, or `None`) and `made` (whether the step computed
    it, rather than received it)."""

    name: str
    argument: Optional[str]
    made: bool


def _is_host_tracer(x: Any) -> bool:
    return isinstance(x, Tracer) and getattr(
        getattr(x, "aval", None), "memory_space", None) == jax.memory.Space.Host


def _locals(frame: Any) -> Iterator[tuple[str, Any]]:
    """`(name, value)` of each traced host-memory leaf among `frame`'s locals, the name
    with the leaf's path (`self.weight`)."""
    for local, value in list(frame.f_locals.items()):
        try:
            keyed = jtu.tree_flatten_with_path(value)[0]
        except Exception:  # noqa: BLE001 (a local that is no pytree: not an operand)
            continue
        for path, leaf in keyed:
            if _is_host_tracer(leaf):
                yield local + jtu.keystr(path), leaf


def host_operand(error: BaseException, host_type: str, user_frame: Callable[[Any], bool],
                 argument_of: Callable[[Any], Optional[str]]) -> Optional[HostOperand]:
    """The host-memory operand (of type `host_type`, as `str_short` writes it) of the
    operation JAX refused with `error`: the first such traced leaf among the locals of
    the traceback's frames for which `user_frame(frame)` holds, innermost first (not
    JAX's own frames: `jnp` functions are jitted, their operands arguments of their own
    trace), with the name that frame gives it; `argument_of(tracer)` names the step's
    argument a tracer is. Only the innermost user frame that holds host values is read
    (where the operation is written); where none of them has that type (the operand is
    a temporary, `g.astype(...)`), its first, if the step made them all. Else `None`."""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)][::-1]
    for frame in filter(user_frame, frames):
        held = list(_locals(frame))
        if not held:
            continue
        for name, leaf in held:
            if leaf.aval.str_short() == host_type:
                outer, made = tracer_origin(leaf)
                return HostOperand(name, None if made else argument_of(outer), made)
        if all(tracer_origin(leaf)[1] for _, leaf in held):
            return HostOperand(held[0][0], None, True)
        return None
    return None

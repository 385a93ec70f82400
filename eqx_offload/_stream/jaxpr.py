"""The one jaxpr evaluator.

`evaluate` runs a jaxpr's equations in order; what differs between its users lives in a
*rule*, a function from an equation and its input values to its output values (as in
Equinox's `finalise_eval_jaxpr`):

- `bind` (the default): evaluate the equation as `jax.core.eval_jaxpr` does.
- `inline`: also evaluate nested `jit`s that have no placement of their own, equation by
  equation, so an analysis sees through them (`jnp.where` is one).
- `host.on_host`: an equation traced for device memory, on host operands.

The streamed update runs equations stage by stage with `Env.run` on one `Env`.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.extend.source_info_util as source_info_util


Rule = Callable[[Any, list[Any]], list[Any]]


def bind(eqn: Any, invals: list[Any]) -> list[Any]:
    """Evaluate one equation on `invals`, as `jax.core.eval_jaxpr` does (keeping its
    source location and name stack, so errors and profiles point at the user's code)."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        ans = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(ans) if eqn.primitive.multiple_results else [ans]


def is_var(v: Any) -> bool:
    """A variable of a jaxpr (not a literal constant)."""
    return not isinstance(v, jex.Literal)


class Env:
    """The values of a jaxpr's variables during an evaluation."""

    def __init__(self) -> None:
        self.values: dict[Any, Any] = {}

    def read(self, v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else self.values[v]

    def read_all(self, vs: Sequence[Any]) -> list[Any]:
        return [self.read(v) for v in vs]

    def write(self, vs: Sequence[Any], values: Sequence[Any]) -> None:
        for v, x in zip(vs, values, strict=True):
            self.values[v] = x

    def run(self, eqns: Sequence[Any], rule: Rule = bind) -> None:
        """Evaluate `eqns` in order, reading and writing this environment."""
        for eqn in eqns:
            self.write(eqn.outvars, rule(eqn, self.read_all(eqn.invars)))


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], rule: Rule = bind) -> list[Any]:
    """The outputs of `jaxpr` (a `jax.extend.core.Jaxpr`) on `args`, each equation
    evaluated by `rule`."""
    env = Env()
    env.write(jaxpr.constvars, consts)
    env.write(jaxpr.invars, args)
    env.run(jaxpr.eqns, rule)
    return env.read_all(jaxpr.outvars)


def inlinable(eqn: Any) -> bool:
    """A nested `jit` with no placement of its own: XLA inlines it anyway."""
    if eqn.primitive.name not in ("jit", "pjit") or "jaxpr" not in eqn.params:
        return False
    params = eqn.params
    shardings = tuple(params.get("in_shardings", ())) + tuple(params.get("out_shardings", ()))
    return (
        not any(isinstance(s, jax.sharding.Sharding) for s in shardings)
        and not any(params.get("donated_invars", ()))
        and not params.get("compiler_options_kvs")
        and getattr(eqn.ctx, "compute_type", None) is None
    )


def inline(eqn: Any, invals: list[Any]) -> list[Any]:
    """The rule that evaluates inlinable nested `jit`s equation by equation."""
    if inlinable(eqn):
        closed = eqn.params["jaxpr"]
        return evaluate(closed.jaxpr, closed.consts, invals, inline)
    return bind(eqn, invals)


def where_made(eqn: Any) -> str:
    """`"`name` at file:line (function)"`: where an equation was traced."""
    return f"`{eqn.primitive.name}` at {source_info_util.summarize(eqn.source_info)}"

"""Tracing an update to one flat jaxpr, and the one jaxpr evaluator.

`evaluate` runs a jaxpr's equations in order; what differs between its users lives in a
*rule*, a function from an equation and its input values to its output values (as in
Equinox's `finalise_eval_jaxpr`):

- `bind` (the default): evaluate the equation as `jax.core.eval_jaxpr` does. `filter_jit`
  replays a traced step with it, so the user's function runs once per compilation.
- `inline`: also evaluate nested `jit`s that have no placement of their own, equation by
  equation, so an analysis sees through them (`jnp.where` is one).
- the host-compute rule in `host_compute`.

The streamed update runs equations stage by stage with `run` on one `Env`.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Optional

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.extend.source_info_util as source_info_util
import jax.tree_util as jtu

from .._core.leaves import path_to_str


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


def _inlinable(eqn: Any) -> bool:
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
    if _inlinable(eqn):
        closed = eqn.params["jaxpr"]
        return evaluate(closed.jaxpr, closed.consts, invals, inline)
    return bind(eqn, invals)


@dataclasses.dataclass
class TracedUpdate:
    """`inner.update(updates, state, params, **extra_args)` as one flat jaxpr.

    The jaxpr's inputs are the array leaves of `(updates, state, params, extra_args)` in
    that order; its outputs the array leaves of `(new_updates, new_state)`."""

    jaxpr: Any  # jax.extend.core.Jaxpr, with nested placement-free jits inlined
    consts: list[Any]
    flat_args: list[Any]
    state_paths: list[str]  # paths of the state's array leaves, in flat order
    state_offset: int  # index of the first state leaf in `flat_args`
    n_updates_out: int
    out_treedef: Any
    out_static: Any

    @property
    def state_slice(self) -> slice:
        return slice(self.state_offset, self.state_offset + len(self.state_paths))

    def rebuild(self, flat_out: Sequence[Any]) -> tuple[Any, Any]:
        """`(updates, state)` from the jaxpr's flat outputs."""
        dyn_updates, dyn_state = jtu.tree_unflatten(self.out_treedef, list(flat_out))
        updates, state = eqx.combine((dyn_updates, dyn_state), self.out_static)
        return updates, state


def _spec(leaf: Any) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(leaf)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def trace_update(
    inner: Any, updates: Any, inner_state: Any, params: Any, extra_args: dict[str, Any],
    state_dtypes: Optional[Sequence[Any]] = None,
) -> TracedUpdate:
    """Trace `inner.update` on these arguments' shapes to one flat jaxpr (with the state's
    array leaves in `state_dtypes`, if given: the dtypes the update computes in)."""
    dynamic, static = eqx.partition((updates, inner_state, params, extra_args), eqx.is_array)
    flat, in_treedef = jtu.tree_flatten(dynamic)
    state_offset = len(jtu.tree_leaves(dynamic[0]))
    out_static: list[Any] = []

    def run(*leaves: Any) -> Any:
        u, s, p, e = eqx.combine(jtu.tree_unflatten(in_treedef, leaves), static)
        dyn_out, static_out = eqx.partition(inner.update(u, s, p, **e), eqx.is_array)
        out_static[:] = [static_out]
        return dyn_out

    specs = [_spec(x) for x in flat]
    for i, dtype in enumerate(state_dtypes or ()):
        spec = specs[state_offset + i]
        specs[state_offset + i] = jax.ShapeDtypeStruct(spec.shape, dtype, weak_type=spec.weak_type)
    closed, out_shape = jax.make_jaxpr(run, return_shape=True)(*specs)
    if any(_inlinable(e) for e in closed.jaxpr.eqns):
        closed = jax.make_jaxpr(functools.partial(_evaluate_inlined, closed))(*specs)
    return TracedUpdate(
        jaxpr=closed.jaxpr,
        consts=list(closed.consts),
        flat_args=flat,
        state_paths=[path_to_str(p) for p, _ in jtu.tree_flatten_with_path(dynamic[1])[0]],
        state_offset=state_offset,
        n_updates_out=len(jtu.tree_leaves(out_shape[0])),
        out_treedef=jtu.tree_structure(out_shape),
        out_static=out_static[0],
    )


def _evaluate_inlined(closed: Any, *args: Any) -> list[Any]:
    return evaluate(closed.jaxpr, closed.consts, args, inline)


def where_made(eqn: Any) -> str:
    """`"`name` at file:line (function)"`: where an equation was traced."""
    return f"`{eqn.primitive.name}` at {source_info_util.summarize(eqn.source_info)}"

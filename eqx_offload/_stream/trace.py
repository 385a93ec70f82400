"""An update traced to one flat jaxpr (`trace_update`), and the checks that it can be
streamed at all (`trace_streamable`): what every way of running it starts from."""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Optional

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._core.errors import NotStreamable
from .._core.leaves import path_to_str
from .jaxpr import evaluate, inlinable, inline


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
    array leaves in `state_dtypes`, if given: the dtypes the update computes in; a
    `jax.ShapeDtypeStruct` where the shape changes too, as 8-bit state's does)."""
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
        if isinstance(dtype, jax.ShapeDtypeStruct):
            spec, dtype = dtype, dtype.dtype
        specs[state_offset + i] = jax.ShapeDtypeStruct(spec.shape, dtype, weak_type=spec.weak_type)
    closed, out_shape = jax.make_jaxpr(run, return_shape=True)(*specs)
    if any(inlinable(e) for e in closed.jaxpr.eqns):
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


def trace_streamable(inner: Any, updates: Any, inner_state: Any, params: Any,
                     extra_args: dict[str, Any],
                     state_dtypes: Optional[Sequence[Any]] = None) -> TracedUpdate:
    """`trace_update`, with a `NotStreamable` for an update with side effects (streaming
    reorders its operations) or one whose new state is not shaped as its state."""
    traced = trace_update(inner, updates, inner_state, params, extra_args, state_dtypes)
    if traced.jaxpr.effects:
        raise NotStreamable(
            "offloaded(..., group_bytes=...): the inner update has side effects "
            f"({', '.join(sorted(map(str, traced.jaxpr.effects)))}), e.g. a callback or "
            "`jax.debug.print`; streaming reorders its operations, so it is not done. "
            "Use group_bytes=None."
        )
    out_state: Any = jtu.tree_structure(traced.rebuild(
        [v.aval for v in traced.jaxpr.outvars])[1])  # PyTreeDef: typed without __eq__
    in_state: Any = jtu.tree_structure(inner_state)
    if out_state != in_state:
        raise NotStreamable(
            "offloaded(..., group_bytes=...): the inner transformation returns a state "
            "whose structure differs from that of the state it was given, so new "
            "state leaves cannot be matched to old ones. Use group_bytes=None."
        )
    return traced

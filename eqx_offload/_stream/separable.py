"""Whether an update treats the layers of stacked leaves apart: a walk of its jaxpr.

The update inside the backward pass runs an optimizer's update on one layer's slice of
the stacked leaves at a time. That is the normal step only if, in the update of the
whole tree, no value of layer `i` is computed from another layer's values, and the
leaves of the stacked layers and the others do not mix (a global norm, a clip by a
leaf's RMS over all its layers, a factored moment over the layer axis all do). `check`
follows the layer axis of every value through the jaxpr of the update on the stacked
tree, and names the first equation that mixes; a primitive it does not know counts as
mixing (it refuses rather than guesses).
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Optional

import jax.extend.core as jex
import jax.extend.source_info_util as source_info_util


BLOCK, REST = "layers", "rest"


@dataclasses.dataclass(frozen=True)
class Mark:
    """What one value depends on: `groups` (`BLOCK`: a stacked layer leaf; `REST`: a
    leaf outside the stack) and, where it depends on the layers, the position of the
    layer axis in its shape (`None` where it has none: the layers were mixed)."""

    groups: frozenset[str] = frozenset()
    axis: Optional[int] = None


SHARED = Mark()


class Mixes(Exception):
    """The update mixes what it must keep apart; the message says where."""


# Primitives that act elementwise (on operands of one shape, or 0-d ones).
_ELEMENTWISE = frozenset("""
    abs add and atan2 cbrt ceil clamp convert_element_type copy copy_p cos cosh div eq
    erf erf_inv exp exp2 expm1 floor ge gt imag integer_pow is_finite le log log1p
    logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem round
    rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan tanh xor
    device_put optimization_barrier eq_to le_to lt_to shift_left shift_right_logical
    shift_right_arithmetic population_count
""".split())
_REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or "
                        "argmax argmin".split())
_CALLS = frozenset("jit pjit closed_call core_call remat checkpoint custom_jvp_call "
                   "custom_vjp_call custom_vjp_call_jaxpr".split())


def check(jaxpr: Any, marks: Sequence[Mark], expected: Sequence[Mark]) -> None:
    """Raises `Mixes` unless every output of `jaxpr` (a `ClosedJaxpr`) depends only on
    what its `expected` mark allows: an output marked `BLOCK` on no `REST` input and
    with its layer axis at 0; one marked `REST` on no `BLOCK` input; a `SHARED` one on
    neither. `marks`: one per input."""
    outs = _walk(jaxpr.jaxpr, list(marks))
    for n, (got, want) in enumerate(zip(outs, expected, strict=True)):
        extra = got.groups - want.groups
        if extra:
            raise Mixes(f"output {n} (of the {_name(want)}) depends on the "
                        f"{' and '.join(sorted(_group_name(g) for g in extra))}")
        if BLOCK in got.groups and got.axis != 0:
            raise Mixes(f"output {n} loses its layer axis")


def _name(mark: Mark) -> str:
    return _group_name(next(iter(mark.groups))) if mark.groups else "shared state"


def _group_name(group: str) -> str:
    return "stacked layers" if group == BLOCK else "leaves outside the layers"


def _walk(jaxpr: Any, marks: list[Mark]) -> list[Mark]:
    env: dict[Any, Mark] = dict(zip(jaxpr.invars, marks, strict=True))
    for v in jaxpr.constvars:
        env[v] = SHARED

    def read(v: Any) -> Mark:
        return SHARED if isinstance(v, jex.Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if not any(BLOCK in m.groups for m in ins):
            groups = frozenset().union(*(m.groups for m in ins))
            outs = [Mark(groups) for _ in eqn.outvars]
        else:
            try:
                outs = _rule(eqn, ins)
            except Mixes as e:
                where = source_info_util.summarize(eqn.source_info)
                raise Mixes(f"`{eqn.primitive.name}` at {where}: {e}") from None
        for v, m in zip(eqn.outvars, outs, strict=True):
            env[v] = m
    return [read(v) for v in jaxpr.outvars]


def _rule(eqn: Any, ins: list[Mark]) -> list[Mark]:
    """The marks of an equation's outputs, some input of which depends on the layers."""
    name = eqn.primitive.name
    groups = frozenset().union(*(m.groups for m in ins))
    shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
    axes = [m.axis for m in ins if BLOCK in m.groups]
    if name == "cond":
        return _cond(eqn, ins)
    if name in _CALLS:
        sub = _sub_jaxpr(eqn)
        if sub is None:
            raise Mixes("a call whose jaxpr is not in its parameters")
        if len(sub.invars) != len(ins):
            raise Mixes("a call whose jaxpr takes other arguments")
        return _walk(sub, ins)
    if name in ("device_put", "optimization_barrier"):  # one output per operand
        return [Mark(m.groups, m.axis) for m in ins]
    if name in _ELEMENTWISE:
        out_rank = len(eqn.outvars[0].aval.shape)
        if any(len(s) not in (0, out_rank) for s in shapes) or len(set(axes)) != 1:
            raise Mixes("operands of different shapes")
        return [Mark(groups, axes[0]) for _ in eqn.outvars]
    if name == "gather":
        return [Mark(groups, _gather_axis(eqn, ins, shapes))]
    if name == "pad":  # (the operand, and a padding value of no layer)
        if BLOCK in ins[1].groups or ins[0].axis is None:
            raise Mixes("a padding value of the layers")
        low, high, interior = eqn.params["padding_config"][ins[0].axis]
        if (low, high, interior) != (0, 0, 0):
            raise Mixes("a pad of the layer axis")
        return [Mark(groups, ins[0].axis)]
    if name == "concatenate":
        if any(BLOCK not in m.groups for m in ins) or len(set(axes)) != 1:
            raise Mixes("a concatenation of the layers with other values")
        if axes[0] is None or eqn.params["dimension"] == axes[0]:
            raise Mixes("a concatenation along the layer axis")
        return [Mark(groups, axes[0])]
    if len(eqn.invars) == 1 or name in _REDUCTIONS or name == "dot_general":
        return [Mark(groups, _unary_axis(eqn, name, ins, shapes))]
    raise Mixes("not known to treat the layers apart")


def _gather_axis(eqn: Any, ins: list[Mark], shapes: list[Any]) -> int:
    """A gather from values of no layer at indices of the layers (a table lookup): the
    layer axis of the indices, at its place among the output's batch axes."""
    operand, indices = ins
    if BLOCK in operand.groups or indices.axis is None:
        raise Mixes("a gather from the layers")
    if indices.axis == len(shapes[1]) - 1:
        raise Mixes("a gather along the layer axis")
    offset = eqn.params["dimension_numbers"].offset_dims
    batch = [d for d in range(len(eqn.outvars[0].aval.shape)) if d not in offset]
    return batch[indices.axis]


def _cond(eqn: Any, ins: list[Mark]) -> list[Mark]:
    """Each branch walked; an output's mark is the union of the branches'. A branch
    chosen by the layers' values mixes them."""
    if BLOCK in ins[0].groups:
        raise Mixes("a branch chosen by the layers' values")
    outs: Optional[list[Mark]] = None
    for branch in eqn.params["branches"]:
        marks = _walk(branch.jaxpr, ins[1:])
        if outs is None:
            outs = marks
            continue
        for n, (a, b) in enumerate(zip(outs, marks, strict=True)):
            if BLOCK in a.groups and BLOCK in b.groups and a.axis != b.axis:
                raise Mixes("branches that put the layer axis in different places")
            outs[n] = Mark(a.groups | b.groups, a.axis if BLOCK in a.groups else b.axis)
    return outs or []


def _unary_axis(eqn: Any, name: str, ins: list[Mark], shapes: list[Any]) -> int:
    params = eqn.params
    if name == "dot_general":
        return _dot_axis(params["dimension_numbers"], ins, shapes)
    (axis,) = {m.axis for m in ins if BLOCK in m.groups}
    if axis is None:
        raise Mixes("a value without its layer axis")
    if name in _REDUCTIONS:
        reduced = tuple(params["axes"])
        if axis in reduced:
            raise Mixes("a reduction over the layer axis")
        return axis - sum(1 for a in reduced if a < axis)
    if name == "broadcast_in_dim":
        new = params["broadcast_dimensions"][axis]
        if params["shape"][new] != shapes[0][axis]:
            raise Mixes("a broadcast of the layer axis")
        return int(new)
    if name == "transpose":
        return list(params["permutation"]).index(axis)
    if name == "squeeze":
        if axis in params["dimensions"]:
            raise Mixes("a squeeze of the layer axis")
        return axis - sum(1 for a in params["dimensions"] if a < axis)
    if name == "reshape":
        return _reshape_axis(shapes[0], tuple(eqn.outvars[0].aval.shape), axis)
    if name == "slice":
        strides = params["strides"] or (1,) * len(shapes[0])
        if (params["start_indices"][axis], params["limit_indices"][axis],
                strides[axis]) != (0, shapes[0][axis], 1):
            raise Mixes("a slice of the layer axis")
        return axis
    if name == "bitcast_convert_type":  # (a trailing axis added or removed)
        rank_in, rank_out = len(shapes[0]), len(eqn.outvars[0].aval.shape)
        if axis >= min(rank_in, rank_out) or (rank_out < rank_in and axis == rank_in - 1):
            raise Mixes("a bitcast of the layer axis")
        return axis
    if name in _ELEMENTWISE:
        return axis
    raise Mixes("not known to treat the layers apart")


def _reshape_axis(shape: tuple[int, ...], new: tuple[int, ...], axis: int) -> int:
    before = math.prod(shape[:axis])
    for j in range(len(new)):
        if math.prod(new[:j]) == before and new[j] == shape[axis]:
            return j
    raise Mixes("a reshape that merges the layer axis")


def _dot_axis(numbers: Any, ins: list[Mark], shapes: list[Any]) -> int:
    (lc, rc), (lb, rb) = numbers
    lhs, rhs = ins
    place: set[int] = set()
    for side, (m, contract, batch, shape) in enumerate(
            ((lhs, lc, lb, shapes[0]), (rhs, rc, rb, shapes[1]))):
        if BLOCK not in m.groups:
            continue
        if m.axis is None or m.axis in contract:
            raise Mixes("a contraction over the layer axis")
        if m.axis in batch:
            place.add(list(batch).index(m.axis))
            continue
        free_lhs = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
        free_rhs = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]
        if side == 0:
            place.add(len(lb) + free_lhs.index(m.axis))
        else:
            place.add(len(lb) + len(free_lhs) + free_rhs.index(m.axis))
    if len(place) != 1:
        raise Mixes("a product of two layers")
    return place.pop()


def _sub_jaxpr(eqn: Any) -> Any:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            return getattr(sub, "jaxpr", sub)
    return None

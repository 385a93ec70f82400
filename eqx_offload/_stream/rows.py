"""Stacked leaves split by rows: which units can be (`sliceable`), the equations a
piece runs (`piece_eqns`), and where its rows of an update are written (`tails`).
Decided on the traced update itself, so the pieces compute what `inner.update` does,
bitwise."""

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax
import numpy as np

from .jaxpr import is_var
from .trace import TracedUpdate
from .units import Units


# index of their operands (0-d operands broadcast): evaluated on rows `a:b` of every
# operand, they give rows `a:b` of their results, exactly.
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "cbrt", "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh",
    "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt",
    "integer_pow", "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "nextafter", "not", "or", "pow", "reduce_precision", "rem",
    "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "sub", "tan",
    "tanh", "xor",
})

MIN_SLICED_NDIM = 3
"""A unit is split along its leading axis only if its state leaves have at least this
many dimensions: stacked layers (`eqx.filter_vmap` over a layer gives `(layers, d_in,
d_out)` weights). Matrices (an embedding's `(vocab, d)`) are brought whole, as before."""


def _rows_sharded(aval: Any) -> bool:
    """Whether an abstract value's type shards its leading axis (explicit sharding): JAX
    cannot slice a few rows out of that, so such a leaf is brought whole."""
    spec: Any = getattr(getattr(aval, "sharding", None), "spec", None) or ()
    return len(spec) > 0 and spec[0] is not None


def _is_fetch(eqn: Any) -> bool:
    """A move of one value to device memory (`host_weights_optimizer` fetches each host
    parameter so, `fetch_each`): rows `a:b` moved are the moved value's rows `a:b`."""
    return (eqn.primitive.name == "device_put" and len(eqn.invars) == 1
            and tuple(eqn.params.get("devices", ())) == (jax.memory.Space.Device,))


def row_wise(eqn: Any, rows: int) -> bool:
    """Whether `eqn` computes rows `a:b` of its results from rows `a:b` of its operands of
    at least one dimension, for every `a:b` along a leading axis of `rows`."""
    if eqn.primitive.name not in ELEMENTWISE and not _is_fetch(eqn):
        return False
    shapes = [tuple(v.aval.shape) for v in eqn.outvars]
    shape = shapes[0]
    if not shape or shape[0] != rows or any(s != shape for s in shapes):
        return False
    return all(not v.aval.shape or tuple(v.aval.shape) == shape for v in eqn.invars)


def sliceable(traced: TracedUpdate, units: Units, streamed: Sequence[int]) -> dict[int, int]:
    """The units (by root) whose update can be split along the leading axis of their
    state leaves, with that axis' length: every state leaf of the unit has at least
    `MIN_SLICED_NDIM` dimensions and the same leading one; every equation that depends
    on the unit is elementwise (`row_wise`), so reads no row of another row; and each
    new state leaf it makes is the new value of one of its own leaves, of that shape
    (it goes back into that leaf's host buffer, row by row).

    This is decided on the traced update itself, as the groups are: whatever reduces
    across a leaf (a norm for a trust ratio as in `lamb`/`lars`, `adafactor`'s factored
    moments and its update clipping, a mask's gathers) makes its unit whole again, and
    the results stay those of `inner.update`, bitwise."""
    jaxpr = traced.jaxpr
    state_invars = jaxpr.invars[traced.state_slice]
    members: dict[int, list[int]] = {}
    for i in streamed:
        members.setdefault(units.uf.find(i), []).append(i)
    # (The jaxpr is traced without shardings: the arguments have them. A gradient or
    # parameter of a state leaf's shape is sharded as the leaf.)
    sharded = {tuple(np.shape(x)) for x in traced.flat_args if _rows_sharded(jax.typeof(x))}
    rows: dict[int, int] = {}
    for root, leaves in members.items():
        shapes = {tuple(state_invars[i].aval.shape) for i in leaves}
        if (all(len(s) >= MIN_SLICED_NDIM for s in shapes) and len({s[0] for s in shapes}) == 1
                and not shapes & sharded):
            rows[root] = next(iter(shapes))[0]
    has_eqns: set[int] = set()
    for eqn, unit in zip(jaxpr.eqns, units.eqn_unit, strict=True):
        if unit is None:
            continue
        root = units.uf.find(unit)
        has_eqns.add(root)
        if root in rows and not row_wise(eqn, rows[root]):
            del rows[root]
    own = {v: i for i, v in enumerate(state_invars)}
    for k, v in enumerate(jaxpr.outvars):
        if not is_var(v) or v not in units.unit_of_var or v in own:
            continue
        root = units.uf.find(units.unit_of_var[v])
        if root not in rows or k < traced.n_updates_out:
            continue
        i = k - traced.n_updates_out
        if i not in members[root] or state_invars[i].aval.shape != v.aval.shape:
            del rows[root]
    return {root: n for root, n in rows.items() if root in has_eqns}


def piece_eqns(jaxpr: Any, units: Units, split: dict[int, int]) -> dict[int, list[Any]]:
    """The equations each split unit runs once per piece: its own, and those computed
    without the state (`(1 - b1) * g`) that are elementwise along the same rows and
    feed only it. A piece is then the unit's update as `inner.update` writes it, on
    fewer rows (only the gradients, parameters and state are sliced), and XLA compiles
    it as it compiles the whole leaf's: computed whole and sliced, `(1 - b1) * g`
    would be fused differently (on the CPU backend, one ulp apart in `mu`)."""
    owner: list[Optional[int]] = []
    for unit in units.eqn_unit:
        root = None if unit is None else units.uf.find(unit)
        owner.append(root if root in split else None)
    consumers: dict[Any, set[Optional[int]]] = {}
    outputs = {v for v in jaxpr.outvars if is_var(v)}
    for j in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[j]
        if owner[j] is None and units.eqn_unit[j] is None and not (set(eqn.outvars) & outputs):
            users: set[Optional[int]] = set().union(
                *(consumers.get(o, {None}) for o in eqn.outvars))
            root = next(iter(users)) if len(users) == 1 else None
            if root is not None and row_wise(eqn, split[root]):
                owner[j] = root
        for v in eqn.invars:
            if is_var(v):
                consumers.setdefault(v, set()).add(owner[j])
    pieces: dict[int, list[Any]] = {root: [] for root in split}
    for eqn, root in zip(jaxpr.eqns, owner, strict=True):
        if root is not None:
            pieces[root].append(eqn)
    return pieces


def keep_scalar_uses(jaxpr: Any, pieces: dict[int, list[Any]],
                     rows: dict[int, int]) -> dict[int, int]:
    """The split units less those whose pieces would read a scalar that only one
    operation of the update reads (Adam's bias corrections when one parameter has any
    state): split, it has as many readers as pieces, and XLA's algebraic simplifier
    rewrites a division by a scalar with one reader differently from one with several
    (on the CPU backend `m / c / d` becomes `m * (1 / c) / d` or `m / (c * d)`: one ulp
    apart). With two or more parameters the unwrapped update has several readers too."""
    readers: dict[Any, int] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if is_var(v) and not v.aval.shape:
                readers[v] = readers.get(v, 0) + 1
    return {root: n for root, n in rows.items()
            if not any(readers.get(v) == 1 for e in pieces[root] for v in e.invars if is_var(v))}


@dataclasses.dataclass
class Sliced:
    """A unit whose update runs piece by piece (rows of its leaves' leading axis)."""

    eqns: list[Any]  # its equations, in order, run once per piece on the piece's rows
    read: list[int]  # the state leaves its equations read
    outputs: list[int]  # the jaxpr outputs its equations make
    # update output -> (the value its pieces write row by row, the equations that make
    # the update from it once all rows are written): see `tails`
    tails: dict[int, tuple[Any, list[Any]]] = dataclasses.field(default_factory=dict)


_MULTIPLY = frozenset({"mul", "square", "integer_pow"})


def converts_only(tail: Sequence[Any]) -> bool:
    return all(eqn.primitive.name == "convert_element_type" for eqn in tail)


def tails(jaxpr: Any, unit: Sliced, n_updates: int) -> dict[int, tuple[Any, list[Any]]]:
    """For each update a split unit makes, where its pieces can store their rows so
    that the update needs no buffer of its own and the program still computes what
    `inner.update` does, bitwise.

    The update of a stacked leaf is read by `apply_updates` only when every row is
    computed. Left to XLA, all pieces' rows are kept until then in whatever form XLA
    fuses (in the GPU plan: the new `mu` and `nu` of every piece, as much as the whole
    state). So each piece writes its rows into the buffer of the gradient (in place;
    its rows of the gradient are read first). What it writes is the value before the
    update's trailing operations with a scalar (`* -learning_rate`): those run once on
    the whole leaf, so XLA fuses them into `apply_updates` exactly as in the unwrapped
    step (where `p + (-lr) * u` may become one fused multiply-add: a stored product
    would round differently). A value made by a multiplication that the next
    operation adds to is never the one written, for the same reason: such an update
    is concatenated instead."""
    producer = {o: e for e in unit.eqns for o in e.outvars}
    uses: dict[Any, int] = {}
    for v in [*(x for e in jaxpr.eqns for x in e.invars), *jaxpr.outvars]:
        if is_var(v):
            uses[v] = uses.get(v, 0) + 1
    tails: dict[int, tuple[Any, list[Any]]] = {}
    for k in unit.outputs:
        if k >= n_updates:
            continue
        v = jaxpr.outvars[k]
        tail: list[Any] = []
        while v in producer and uses[v] == 1:
            eqn = producer[v]
            rows = [x for x in eqn.invars if x.aval.shape]
            if len(rows) != 1 or not is_var(rows[0]) or rows[0] not in producer:
                break
            tail.insert(0, eqn)
            v = rows[0]
        consumer = tail[0].primitive.name if tail else "add"  # `apply_updates` adds it
        if producer[v].primitive.name in _MULTIPLY and consumer in ("add", "sub"):
            continue
        tails[k] = (v, tail)
    return tails

"""The analysis of the streamed update: from the update's jaxpr alone, the units of
state leaves read together, their groups, the pieces of split stacked leaves, and the
stage of every equation (`schedule`). No transfers, nothing run: `stream` runs the
schedule; its module docstring tells how groups are found and why it stays bitwise."""

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional, Union

import jax
import numpy as np

from .._core.errors import NotStreamable
from .._core.leaves import nbytes
from .._core.placement import is_host
from .jaxpr import is_var, TracedUpdate, where_made


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """How `offloaded(inner, group_bytes=N)` streams a state through the device.

    **Fields:**

    - `groups`: for each group, in the order the update runs them, the paths (as in
        `eqx_offload.pattern`, relative to the inner state) of its state leaves; a
        piece of a stacked leaf split by layers names its rows,
        `"0/mu/layers/weight[0:2]"`.
    - `group_nbytes`: the bytes of state each group brings to the device (as the
        update computes on it: after widening, with `host_dtype`).
    - `prologue`: offloaded 0-d leaves (e.g. a step counter, when `where` selects it);
        every group reads them, so they come to the device once, before the first group.
    - `resident`: state leaves that stay on the device (not selected by `where`).

    The state's share of peak device memory during the update is about
    `(lookahead + 2) * max_group_nbytes` plus the prologue (one group computing, the
    next `lookahead` arriving, the previous one leaving), instead of the whole
    offloaded state.
    """

    groups: tuple[tuple[str, ...], ...]
    group_nbytes: tuple[int, ...]
    prologue: tuple[str, ...]
    resident: tuple[str, ...]

    @property
    def max_group_nbytes(self) -> int:
        """The bytes of the largest group (0 if nothing is streamed)."""
        return max(self.group_nbytes, default=0)

    @property
    def total_nbytes(self) -> int:
        """The bytes of all groups together: what the default update brings at once."""
        return sum(self.group_nbytes)


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, roots: Sequence[int]) -> int:
        root = min(roots)
        for r in roots:
            self.parent[r] = root
        return root


@dataclasses.dataclass
class _Units:
    """Which streamed state leaves are read together (union-find over dependencies)."""

    uf: _UnionFind
    eqn_unit: list[Optional[int]]  # per equation: the unit it depends on, if any
    unit_of_var: dict[Any, int]  # every variable that depends on one unit
    merges: list[tuple[Any, list[int]]]  # equations that joined units, with the units


def _units(jaxpr: Any, state_invars: Sequence[Any], streamed: Sequence[int]) -> _Units:
    uf = _UnionFind(len(state_invars))
    unit_of_var: dict[Any, int] = {state_invars[i]: i for i in streamed}
    merges: list[tuple[Any, list[int]]] = []
    eqn_unit: list[Optional[int]] = []
    for eqn in jaxpr.eqns:
        roots = sorted({uf.find(unit_of_var[v]) for v in eqn.invars
                        if is_var(v) and v in unit_of_var})
        if len(roots) > 1:
            merges.append((eqn, roots))
        unit = uf.union(roots) if roots else None
        eqn_unit.append(unit)
        if unit is not None:
            unit_of_var.update((o, unit) for o in eqn.outvars)
    return _Units(uf, eqn_unit, unit_of_var, merges)


def _check_not_coupled(traced: TracedUpdate, units: _Units, streamed: Sequence[int]) -> None:
    """A unit that produces the updates of more than one parameter couples them."""
    produces: dict[int, list[int]] = {}
    for k, v in enumerate(traced.jaxpr.outvars[: traced.n_updates_out]):
        if is_var(v) and v in units.unit_of_var:
            produces.setdefault(units.uf.find(units.unit_of_var[v]), []).append(k)
    for root, outs in produces.items():
        if len(outs) < 2:
            continue
        coupled = [traced.state_paths[i] for i in streamed if units.uf.find(i) == root]
        reason = next((e for e, roots in units.merges if units.uf.find(roots[0]) == root), None)
        listed = ", ".join(coupled[:4]) + (", ..." if len(coupled) > 4 else "")
        raise NotStreamable(
            "offloaded(..., group_bytes=...): this optimizer's update cannot be "
            f"streamed. It couples the state of {len(outs)} parameters (state "
            f"leaves {listed}): no group boundary can be drawn between them"
            + (f"; the coupling is made by {where_made(reason)}" if reason else "")
            + ". Transformations that combine all of the new state (e.g. "
            "`optax.apply_if_finite`, `optax.MultiSteps`, or a global norm taken "
            "after a stateful transformation as in `chain(adam, "
            "clip_by_global_norm)`) need the whole state on the device at once. "
            "Put global gradient transformations before the stateful ones "
            "(`chain(clip_by_global_norm(...), adam(...))` streams), or use "
            "group_bytes=None."
        )


AUTO_GROUPS = 16
"""`group_bytes="auto"`: the streamed state is cut into about this many groups..."""
AUTO_MAX_GROUP_BYTES = 256 << 20
"""... of at most this many bytes (a bound on the state's share of the update's peak).
There is no lower bound: a state brought to the device whole needs room for itself and
its new value at once, which in the GPU plan of a small MLP is more than the step
without offload holds (1.09x; streamed in 16 groups, 0.66x)."""


def auto_group_bytes(total_bytes: int) -> int:
    """The group size of `group_bytes="auto"` for `total_bytes` of streamed state."""
    return min(AUTO_MAX_GROUP_BYTES, total_bytes // AUTO_GROUPS)


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Rows `rows[0]:rows[1]` (of the leading axis) of every state leaf of a unit that is
    split (see `_sliceable`); `index` counts the unit's pieces, in the order they run."""

    root: int
    index: int
    rows: tuple[int, int]
    last: bool


_Item = tuple[list[int], int, Optional[_Piece]]  # (state leaves, bytes, piece or None)


def _pack(units: _Units, streamed: Sequence[int], sizes: Sequence[int],
          group_bytes: int, sliceable: Optional[dict[int, int]] = None) -> list[list[_Item]]:
    """Units packed into groups of at most `group_bytes` (a unit larger than that is a
    group of its own, or, if it is `sliceable`, pieces of whole rows of at most
    `group_bytes` each, at least one row), in *reverse* leaf order.

    Why reversed: a model written forward (embedding, layers, head, as Equinox modules
    and their pytrees are) gets its gradients last leaf first from the backward pass.
    Groups taken in that order can be updated while the backward pass goes on, each as
    soon as its gradients exist, so every gradient and activation is freed early. In
    leaf order the first group waits for the very last gradient, and XLA keeps the
    backward pass's activations alive until the update of the later layers: in the GPU
    plan of an activation-heavy MLP (H200, `tests/plan/test_plan.py`) that costs 100 MiB
    (357 MiB at the peak instead of 256 MiB; 292 MiB without offload). The order of
    the groups changes nothing in the results: each equation computes what it did.
    (A stacked leaf's gradient comes out of the backward `scan` whole, so the pieces of
    a unit are taken in row order.)"""
    sliceable = sliceable or {}
    members: dict[int, list[int]] = {}
    for i in streamed:
        members.setdefault(units.uf.find(i), []).append(i)
    items: list[_Item] = []
    for root, unit in sorted(members.items(), key=lambda kv: min(kv[1]), reverse=True):
        size = sum(sizes[i] for i in unit)
        rows = sliceable.get(root, 0)
        if size <= group_bytes or rows < 2:
            items.append((list(unit), size, None))
            continue
        per_row = size // rows
        step = max(1, group_bytes // per_row)
        starts = range(0, rows, step)
        for n, a in enumerate(starts):
            b = min(a + step, rows)
            items.append((list(unit), per_row * (b - a),
                          _Piece(root, n, (a, b), n == len(starts) - 1)))
    groups: list[list[_Item]] = []
    group_size = 0
    for item in items:
        if groups and group_size + item[1] <= group_bytes:
            groups[-1].append(item)
            group_size += item[1]
        else:
            groups.append([item])
            group_size = item[1]
    return groups


# Primitives that compute each element of their result from the elements at the same
# index of their operands (0-d operands broadcast): evaluated on rows `a:b` of every
# operand, they give rows `a:b` of their results, exactly.
_ELEMENTWISE = frozenset({
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


def _row_wise(eqn: Any, rows: int) -> bool:
    """Whether `eqn` computes rows `a:b` of its results from rows `a:b` of its operands of
    at least one dimension, for every `a:b` along a leading axis of `rows`."""
    if eqn.primitive.name not in _ELEMENTWISE and not _is_fetch(eqn):
        return False
    shapes = [tuple(v.aval.shape) for v in eqn.outvars]
    shape = shapes[0]
    if not shape or shape[0] != rows or any(s != shape for s in shapes):
        return False
    return all(not v.aval.shape or tuple(v.aval.shape) == shape for v in eqn.invars)


def _sliceable(traced: TracedUpdate, units: _Units, streamed: Sequence[int]) -> dict[int, int]:
    """The units (by root) whose update can be split along the leading axis of their
    state leaves, with that axis' length: every state leaf of the unit has at least
    `MIN_SLICED_NDIM` dimensions and the same leading one; every equation that depends
    on the unit is elementwise (`_row_wise`), so reads no row of another row; and each
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
        if root in rows and not _row_wise(eqn, rows[root]):
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


def _stages(jaxpr: Any, units: _Units, group_of_leaf: dict[int, int], n_groups: int) -> list[list[Any]]:
    """The equations of each stage (0: before any group; g >= 1: group g), in order.

    An equation that reads offloaded state runs in its group's stage; any other
    (gradient clipping, schedules, bias corrections) in that of its first consumer, or
    0. Such equations read device values, which pass through no barrier, so XLA sees
    the same data flow as in the unwrapped update and optimises it the same way (its
    algebraic rewrites depend on the surrounding program, and results stay bitwise
    equal only if that is unchanged)."""
    never = n_groups + 1
    first_use: dict[Any, int] = {v: 0 for v in jaxpr.outvars if is_var(v)}
    stage_of = [0] * len(jaxpr.eqns)
    for j in reversed(range(len(jaxpr.eqns))):
        eqn, unit = jaxpr.eqns[j], units.eqn_unit[j]
        if unit is not None:
            stage = group_of_leaf[units.uf.find(unit)]
        else:
            stage = min((first_use.get(o, never) for o in eqn.outvars), default=never)
            stage = 0 if stage == never else stage
        stage_of[j] = stage
        for v in eqn.invars:
            if is_var(v):
                first_use[v] = min(first_use.get(v, never), stage)
    stages: list[list[Any]] = [[] for _ in range(n_groups + 1)]
    for eqn, stage in zip(jaxpr.eqns, stage_of, strict=True):
        stages[stage].append(eqn)
    return stages


def _piece_eqns(jaxpr: Any, units: _Units, split: dict[int, int]) -> dict[int, list[Any]]:
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
            if root is not None and _row_wise(eqn, split[root]):
                owner[j] = root
        for v in eqn.invars:
            if is_var(v):
                consumers.setdefault(v, set()).add(owner[j])
    pieces: dict[int, list[Any]] = {root: [] for root in split}
    for eqn, root in zip(jaxpr.eqns, owner, strict=True):
        if root is not None:
            pieces[root].append(eqn)
    return pieces


def _keep_scalar_uses(jaxpr: Any, pieces: dict[int, list[Any]],
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
class _Sliced:
    """A unit whose update runs piece by piece (rows of its leaves' leading axis)."""

    eqns: list[Any]  # its equations, in order, run once per piece on the piece's rows
    read: list[int]  # the state leaves its equations read
    outputs: list[int]  # the jaxpr outputs its equations make
    # update output -> (the value its pieces write row by row, the equations that make
    # the update from it once all rows are written): see `_tails`
    tails: dict[int, tuple[Any, list[Any]]] = dataclasses.field(default_factory=dict)


_MULTIPLY = frozenset({"mul", "square", "integer_pow"})


def _converts_only(tail: Sequence[Any]) -> bool:
    return all(eqn.primitive.name == "convert_element_type" for eqn in tail)


def _tails(jaxpr: Any, unit: _Sliced, n_updates: int) -> dict[int, tuple[Any, list[Any]]]:
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


@dataclasses.dataclass
class _Schedule:
    plan: StreamPlan
    stages: list[list[Any]]  # equations per stage (0: prologue, g >= 1: group g)
    group_invars: list[list[Any]]  # per stage: the state variables it brings in whole
    host_outputs: set[int]  # indices of the jaxpr outputs that go back to host
    pieces: list[list[_Piece]]  # per stage: the pieces of split units it runs
    sliced: dict[int, _Sliced]  # the split units, by root


def _schedule(traced: TracedUpdate, group_bytes: Union[int, str]) -> _Schedule:
    jaxpr = traced.jaxpr
    state_invars = jaxpr.invars[traced.state_slice]
    state_leaves = traced.flat_args[traced.state_slice]
    offloaded = [is_host(x) for x in state_leaves]
    streamed = [i for i, x in enumerate(state_leaves) if offloaded[i] and np.ndim(x) > 0]
    prologue = [i for i, x in enumerate(state_leaves) if offloaded[i] and np.ndim(x) == 0]
    sizes = [nbytes(v.aval) for v in state_invars]  # as computed on: after widening

    units = _units(jaxpr, state_invars, streamed)
    _check_not_coupled(traced, units, streamed)
    if group_bytes == "auto":
        group_bytes = auto_group_bytes(sum(sizes[i] for i in streamed))
    rows = _sliceable(traced, units, streamed)
    rows = _keep_scalar_uses(jaxpr, _piece_eqns(jaxpr, units, rows), rows)
    groups = _pack(units, streamed, sizes, int(group_bytes), rows)
    group_of_leaf: dict[int, int] = {}
    pieces: list[list[_Piece]] = [[] for _ in range(len(groups) + 1)]
    for g, items in enumerate(groups):
        for leaves, _, piece in items:
            for i in leaves:
                group_of_leaf.setdefault(i, g + 1)  # a split unit: the stage of its first piece
            if piece is not None:
                pieces[g + 1].append(piece)
    stages = _stages(jaxpr, units, group_of_leaf, len(groups))

    split = {p.root: rows[p.root] for ps in pieces for p in ps}
    read = {v for eqn in jaxpr.eqns for v in eqn.invars if is_var(v)}
    sliced = {root: _Sliced(eqns, [], []) for root, eqns in _piece_eqns(jaxpr, units, split).items()}
    for root, unit in sliced.items():
        unit.read = [i for i in streamed if units.uf.find(i) == root and state_invars[i] in read]
        made = {o for e in unit.eqns for o in e.outvars}
        unit.outputs = [k for k, v in enumerate(jaxpr.outvars) if is_var(v) and v in made]
        unit.tails = _tails(jaxpr, unit, traced.n_updates_out)
    in_pieces = {id(e) for unit in sliced.values() for e in unit.eqns}
    stages = [[e for e in eqns if id(e) not in in_pieces] for eqns in stages]

    whole = [[i for i in sorted(leaves) if units.uf.find(i) not in split]
             for g in groups for leaves in [[i for item in g for i in item[0]]]]
    group_invars: list[list[Any]] = [[state_invars[i] for i in prologue if state_invars[i] in read]]
    group_invars += [[state_invars[i] for i in g if state_invars[i] in read] for g in whole]
    paths = traced.state_paths

    def shown_paths(items: list[_Item]) -> list[str]:
        """Paths in leaf order; a piece's with its rows, `"0/mu/layers/weight[0:2]"`."""
        names: list[tuple[int, tuple[int, int]]] = []
        for leaves, _, piece in items:
            rows = (0, 0) if piece is None else piece.rows
            names += [(i, rows) for i in leaves]
        return [paths[i] + (f"[{a}:{b}]" if b else "") for i, (a, b) in sorted(names)]

    plan = StreamPlan(
        groups=tuple(tuple(shown_paths(g)) for g in groups),
        group_nbytes=tuple(sum(item[1] for item in g) for g in groups),
        prologue=tuple(paths[i] for i in prologue),
        resident=tuple(p for p, off in zip(paths, offloaded, strict=True) if not off),
    )
    host_outputs = {traced.n_updates_out + i for i, off in enumerate(offloaded) if off}
    return _Schedule(plan, stages, group_invars, host_outputs, pieces, sliced)

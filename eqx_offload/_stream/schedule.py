"""The analysis of the streamed update: from the update's jaxpr alone, the units of
state leaves read together (`units`), their groups and pieces (`groups`, `rows`), and the
stage of every equation (`schedule`). No transfers, nothing run: `runner` runs the
schedule; `update`'s module docstring tells how groups are found and why it stays
bitwise."""

import dataclasses
from typing import Any, Union

import numpy as np

from .._core.leaves import nbytes
from .._core.placement import is_host
from .groups import Item, pack, Piece
from .jaxpr import is_var
from .plan import auto_group_bytes, StreamPlan
from .rows import keep_scalar_uses, piece_eqns, sliceable, Sliced, tails
from .trace import TracedUpdate
from .units import check_not_coupled, find_units, Units


def _stages(jaxpr: Any, units: Units, group_of_leaf: dict[int, int], n_groups: int) -> list[list[Any]]:
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


@dataclasses.dataclass
class Schedule:
    plan: StreamPlan
    stages: list[list[Any]]  # equations per stage (0: prologue, g >= 1: group g)
    group_invars: list[list[Any]]  # per stage: the state variables it brings in whole
    host_outputs: set[int]  # indices of the jaxpr outputs that go back to host
    pieces: list[list[Piece]]  # per stage: the pieces of split units it runs
    sliced: dict[int, Sliced]  # the split units, by root


def schedule(traced: TracedUpdate, group_bytes: Union[int, str]) -> Schedule:
    jaxpr = traced.jaxpr
    state_invars = jaxpr.invars[traced.state_slice]
    state_leaves = traced.flat_args[traced.state_slice]
    offloaded = [is_host(x) for x in state_leaves]
    streamed = [i for i, x in enumerate(state_leaves) if offloaded[i] and np.ndim(x) > 0]
    prologue = [i for i, x in enumerate(state_leaves) if offloaded[i] and np.ndim(x) == 0]
    sizes = [nbytes(v.aval) for v in state_invars]  # as computed on: after widening

    units = find_units(jaxpr, state_invars, streamed)
    check_not_coupled(traced, units, streamed)
    if group_bytes == "auto":
        group_bytes = auto_group_bytes(sum(sizes[i] for i in streamed))
    rows = sliceable(traced, units, streamed)
    rows = keep_scalar_uses(jaxpr, piece_eqns(jaxpr, units, rows), rows)
    groups = pack(units, streamed, sizes, int(group_bytes), rows)
    group_of_leaf: dict[int, int] = {}
    pieces: list[list[Piece]] = [[] for _ in range(len(groups) + 1)]
    for g, items in enumerate(groups):
        for leaves, _, piece in items:
            for i in leaves:
                group_of_leaf.setdefault(i, g + 1)  # a split unit: the stage of its first piece
            if piece is not None:
                pieces[g + 1].append(piece)
    stages = _stages(jaxpr, units, group_of_leaf, len(groups))

    split = {p.root: rows[p.root] for ps in pieces for p in ps}
    read = {v for eqn in jaxpr.eqns for v in eqn.invars if is_var(v)}
    sliced = {root: Sliced(eqns, [], []) for root, eqns in piece_eqns(jaxpr, units, split).items()}
    for root, unit in sliced.items():
        unit.read = [i for i in streamed if units.uf.find(i) == root and state_invars[i] in read]
        made = {o for e in unit.eqns for o in e.outvars}
        unit.outputs = [k for k, v in enumerate(jaxpr.outvars) if is_var(v) and v in made]
        unit.tails = tails(jaxpr, unit, traced.n_updates_out)
    in_pieces = {id(e) for unit in sliced.values() for e in unit.eqns}
    stages = [[e for e in eqns if id(e) not in in_pieces] for eqns in stages]

    whole = [[i for i in sorted(leaves) if units.uf.find(i) not in split]
             for g in groups for leaves in [[i for item in g for i in item[0]]]]
    group_invars: list[list[Any]] = [[state_invars[i] for i in prologue if state_invars[i] in read]]
    group_invars += [[state_invars[i] for i in g if state_invars[i] in read] for g in whole]
    paths = traced.state_paths

    def shown_paths(items: list[Item]) -> list[str]:
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
    return Schedule(plan, stages, group_invars, host_outputs, pieces, sliced)

"""Packing units into groups of at most `group_bytes`, a unit larger than that split
into pieces of whole rows where it can be (`rows.sliceable`)."""

import dataclasses
from collections.abc import Sequence
from typing import Optional

from .units import Units


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows `rows[0]:rows[1]` (of the leading axis) of every state leaf of a unit that is
    split (see `sliceable`); `index` counts the unit's pieces, in the order they run."""

    root: int
    index: int
    rows: tuple[int, int]
    last: bool


Item = tuple[list[int], int, Optional[Piece]]  # (state leaves, bytes, piece or None)


def pack(units: Units, streamed: Sequence[int], sizes: Sequence[int],
         group_bytes: int, sliceable: Optional[dict[int, int]] = None) -> list[list[Item]]:
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
    a unit are taken in row order, and those of a stack's leaves take turns: see
    `interleave`.)"""
    sliceable = sliceable or {}
    members: dict[int, list[int]] = {}
    for i in streamed:
        members.setdefault(units.uf.find(i), []).append(i)
    by_unit: list[list[Item]] = []
    for root, unit in sorted(members.items(), key=lambda kv: min(kv[1]), reverse=True):
        size = sum(sizes[i] for i in unit)
        rows = sliceable.get(root, 0)
        if size <= group_bytes or rows < 2:
            by_unit.append([(list(unit), size, None)])
            continue
        per_row = size // rows
        step = max(1, group_bytes // per_row)
        starts = range(0, rows, step)
        by_unit.append([(list(unit), per_row * (b - a), Piece(root, n, (a, b), n == len(starts) - 1))
                        for n, a in enumerate(starts) for b in [min(a + step, rows)]])
    items = interleave(by_unit, group_bytes)
    groups: list[list[Item]] = []
    group_size = 0
    for item in items:
        if groups and group_size + item[1] <= group_bytes:
            groups[-1].append(item)
            group_size += item[1]
        else:
            groups.append([item])
            group_size = item[1]
    return groups


def interleave(by_unit: list[list[Item]], group_bytes: int) -> list[Item]:
    """The items of each unit (its pieces, or the unit whole), in the order groups take
    them: units in the order given, except that the pieces of split units next to each
    other (with only units smaller than a group between them: a stack's other leaves)
    take turns, one piece of each in turn, after those smaller units.

    Why: a piece's new rows are written into its leaf's host buffer in place, so a
    later piece of the same leaf is read from the buffer that write makes (or the write
    waits for the read). Consecutive groups of one leaf's pieces then alternate the two
    directions of the host link, one after the other; pieces of different leaves in
    consecutive groups let the next group's fetch and this group's write cross at once.
    A stack's leaves get their gradients at once (out of the backward `scan`), so the
    turns delay no update."""
    items: list[Item] = []
    run: list[list[Item]] = []

    def flush() -> None:
        split = [unit for unit in run if len(unit) > 1]
        if len(split) < 2:
            items.extend(item for unit in run for item in unit)
            run.clear()
            return
        items.extend(unit[0] for unit in run if len(unit) == 1)
        for turn in range(max(map(len, split), default=0)):
            items.extend(unit[turn] for unit in split if turn < len(unit))
        run.clear()

    for unit in by_unit:
        if len(unit) == 1 and unit[0][1] >= group_bytes:
            flush()
            items.append(unit[0])
        else:
            run.append(unit)
    flush()
    return items


# Primitives that compute each element of their result from the elements at the same
# index of their operands (0-d operands broadcast): evaluated on rows `a:b` of every

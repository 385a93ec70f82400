"""Units: the streamed state leaves that some operation of the update reads together
(a union-find over the jaxpr's dependencies), and the refusal of an update whose units
couple the state of several parameters."""

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

from .._core.errors import NotStreamable
from .jaxpr import is_var, where_made
from .trace import TracedUpdate


class UnionFind:
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
class Units:
    """Which streamed state leaves are read together (union-find over dependencies)."""

    uf: UnionFind
    eqn_unit: list[Optional[int]]  # per equation: the unit it depends on, if any
    unit_of_var: dict[Any, int]  # every variable that depends on one unit
    merges: list[tuple[Any, list[int]]]  # equations that joined units, with the units


def find_units(jaxpr: Any, state_invars: Sequence[Any], streamed: Sequence[int]) -> Units:
    uf = UnionFind(len(state_invars))
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
    return Units(uf, eqn_unit, unit_of_var, merges)


def check_not_coupled(traced: TracedUpdate, units: Units, streamed: Sequence[int]) -> None:
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

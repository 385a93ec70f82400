"""One evaluation of a schedule: the jaxpr's environment, the values made along the way
(host buffers of split leaves, the rows of pieces, the gradients' buffers that updates
are written into) and what later runs wait for. `runner` runs it."""

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from .._core.placement import is_host
from .jaxpr import Env, is_var
from .rows import converts_only
from .schedule import Schedule
from .trace import TracedUpdate
from .transfers import Transfers


def outputs_by_stage(jaxpr: Any, stages: list[list[Any]]) -> dict[int, list[int]]:
    """For each stage, the indices of the jaxpr outputs its equations make."""
    stage_of_output: dict[Any, int] = {}
    for stage, eqns in enumerate(stages):
        for eqn in eqns:
            for o in eqn.outvars:
                stage_of_output.setdefault(o, stage)
    outputs_of: dict[int, list[int]] = {}
    for k, v in enumerate(jaxpr.outvars):
        if is_var(v) and v in stage_of_output:
            outputs_of.setdefault(stage_of_output[v], []).append(k)
    return outputs_of


_E = TypeVar("_E", bound="Evaluation")


@dataclasses.dataclass
class Evaluation:
    """One evaluation of a schedule, run by run (`runner.run`; run `j` is stage `runs[j]`, the
    stages with something to do): the jaxpr's environment, the values made along the
    way, and what later runs wait for.

    Values are kept in `vals` under keys: `("out", k)` the jaxpr's output `k`;
    `("leaf", i)` the host buffer of state leaf `i` of a split unit, as its pieces come
    back into it (one `dynamic_update_slice` each, in place); `("read", j, root, index,
    i)` a piece's rows of leaf `i`, on the device; `("upd", k, index)` a piece's rows of
    update `k`; `("acc", k)` the gradient buffer a split unit's update `k` is written
    into (`into`)."""

    traced: TracedUpdate
    schedule: Schedule
    transfers: Transfers
    env: Env
    dtype_of: dict[Any, Any]  # state variable -> the dtype of its leaf between steps
    runs: list[int]  # the stages that run, in order
    outputs_of: dict[int, list[int]]  # stage -> the jaxpr outputs its equations make
    sliced_leaves: set[int]  # the state leaves split units write back row by row
    vals: dict[Any, Any] = dataclasses.field(default_factory=dict)
    # update k of a split unit -> (what its pieces write into its gradient's buffer, the
    # equations after that; see `into_gradients`)
    into: dict[int, tuple[Any, list[Any]]] = dataclasses.field(default_factory=dict)
    # updates of split units written row by row into their gradients' host buffers
    into_host: set[int] = dataclasses.field(default_factory=set)
    # root -> {gradient: k}
    source_of: dict[int, dict[Any, int]] = dataclasses.field(default_factory=dict)
    # leaf -> reads of its buffer not yet ordered before a write
    pending: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    # update k of a split unit -> its pieces' keys
    updates_of: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    # per run: the keys later runs wait for
    fences: list[list[Any]] = dataclasses.field(default_factory=list)
    # the new state of the last run, on the device
    latest: list[Any] = dataclasses.field(default_factory=list)
    # the runs whose fetch is traced already (`fetch_early`)
    fetched: set[int] = dataclasses.field(default_factory=set)

    @property
    def jaxpr(self) -> Any:
        return self.traced.jaxpr

    @property
    def n_updates(self) -> int:
        return self.traced.n_updates_out

    @property
    def state_invars(self) -> Any:
        return self.jaxpr.invars[self.traced.state_slice]

    @classmethod
    def start(cls: type[_E], traced: TracedUpdate, schedule: Schedule, transfers: Transfers,
              init_dtypes: Sequence[Any]) -> _E:
        """The evaluation before its first run: the jaxpr's constants and arguments in
        the environment, and under their keys the host buffers of the split units'
        state leaves and the gradient buffers their updates go into."""
        jaxpr = traced.jaxpr
        env = Env()
        env.write(jaxpr.constvars, traced.consts)
        env.write(jaxpr.invars, traced.flat_args)
        state_invars = jaxpr.invars[traced.state_slice]
        n_updates = traced.n_updates_out
        sliced_leaves = {k - n_updates for unit in schedule.sliced.values()
                         for k in unit.outputs if k >= n_updates}
        runs = [s for s, eqns in enumerate(schedule.stages) if s == 0 or eqns or schedule.pieces[s]]
        runner = cls(traced, schedule, transfers, env, dict(zip(state_invars, init_dtypes, strict=True)),
                     runs, outputs_by_stage(jaxpr, schedule.stages), sliced_leaves)
        for i in sliced_leaves.union(*(unit.read for unit in schedule.sliced.values())):
            runner.vals[("leaf", i)] = env.read(state_invars[i])
        runner.into_gradients()
        return runner

    def into_gradients(self) -> None:
        """Where a split unit's updates go: update `k` is written row by row into the
        buffer of the gradient it is computed from (`rows.tails`; each piece reads its rows
        of the gradient before writing them, and the pieces cover every row), if that
        gradient is on the device and of the same type as what is written. A gradient
        in host memory (of a weight kept there) takes the update's rows in host memory
        instead (`into_host`), where the update is of the gradient's type and made
        from the `rows.tails` cut by dtype conversions alone (`master_weights`' new compute
        weights): each piece's rows go to host as they are made, and no device buffer
        holds the whole update (the same conversions on the same rows: bitwise)."""
        gradients = self.jaxpr.invars[: self.traced.state_offset]
        for root, unit in self.schedule.sliced.items():
            for k, (cut, tail) in unit.tails.items():
                if k >= len(gradients):
                    continue
                gradient = gradients[k]
                on_host = is_host(self.env.read(gradient))
                if not on_host and (gradient.aval.shape, gradient.aval.dtype) == (
                        cut.aval.shape, cut.aval.dtype):
                    self.into[k] = (cut, tail)
                elif on_host and converts_only(tail) and (
                        gradient.aval.shape, gradient.aval.dtype) == (
                        self.jaxpr.outvars[k].aval.shape, self.jaxpr.outvars[k].aval.dtype):
                    self.into_host.add(k)
                else:
                    continue
                self.source_of.setdefault(root, {})[gradient] = k
                self.vals[("acc", k)] = self.env.read(gradient)

"""The streamed update: `offloaded`'s default under `jit` (`group_bytes="auto"`), and
`offloaded(..., group_bytes=N)`.

Bringing the whole optimizer state to the device at once needs room for all of it at
the peak of the step (in the GPU plan, the default of earlier releases held as much
device memory as not offloading at all). The streamed update brings it one group of
leaves at a time, so the state's share of peak device memory is a few groups.

How the groups are found, and why the result stays bitwise equal: `inner.update` is
traced once to a jaxpr. A dependency analysis on that jaxpr finds which offloaded state
leaves are read together by some operation (Adam's `mu` and `nu` of one parameter are);
those leaves form an indivisible *unit*. Units are packed in reverse leaf order (the order
the backward pass produces gradients, see `_pack`) into groups of at most `group_bytes`
(`"auto"`: about 1/16 of the streamed state, at most 256 MiB). The jaxpr's own equations are then evaluated stage by stage: each
equation runs in the stage of the group it depends on, and equations that depend on no
offloaded state (gradient clipping by global norm, schedules, bias-correction scalars)
run in the stage of their first consumer. The streamed program is made of exactly the
equations of `inner.update`, so its results are those of `inner.update` by construction.

The order is enforced with data dependencies XLA must respect. The state of group `g`,
still on host, passes through one `jax.lax.optimization_barrier` together with the new
state of group `g - 1 - lookahead`, already sent to host: XLA cannot bring group `g` to
the device before that group is back on host. With `lookahead=1` (the default, double
buffering) group `g + 1` comes in while group `g` is updated and group `g - 1` goes
back, so both copy directions run at once. The same barrier takes the new state of
group `g - 1` as computed on the device (before it is sent to host): group `g` comes in
once the update before it has run, so the state arrives while the backward pass
computes the gradients of the next layer, a group at a time, instead of wherever XLA's
scheduler would start the copy (for the first groups, during the forward pass).
`lookahead=0` brings one group at a time. No other device value is fenced (the
gradients, the updates, scalars), so XLA sees the data flow of the unwrapped update:
the updates fuse into their consumer (`apply_updates`), and every value is computed as
the unwrapped update computes it. (The new state is elementwise and goes to host
anyway; fencing a gradient instead changes how XLA's CPU backend fuses the reduction
that makes it, and with it the last bit of a bias's Adam moments.)

What cannot be streamed (with `group_bytes=N`, a `CompositionError` when the update is
first traced; with `"auto"`, the whole state comes to the device at once instead): an update that
couples the state of several parameters so that no group boundary can be drawn between
them, e.g. `optax.apply_if_finite`, `optax.MultiSteps` or a global statistic computed
*after* a stateful transformation (`chain(adam, clip_by_global_norm)`); and an update
with side effects (callbacks), which streaming would reorder.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional, Union

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
import optax

from ._errors import CompositionError
from ._jaxpr import Env, is_var, trace_update, TracedUpdate, where_made
from ._leaves import nbytes
from ._options import Options
from ._placement import is_host


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """How `offloaded(inner, group_bytes=N)` streams a state through the device.

    **Fields:**

    - `groups`: for each group, in the order the update runs them, the paths (as in
        `eqx_offload.pattern`, relative to the inner state) of its state leaves.
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


# ----------------------------------------------------------------------------------------
# The schedule: units, groups, and the stage of every equation


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
        raise CompositionError(
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
    return int(min(AUTO_MAX_GROUP_BYTES, total_bytes // AUTO_GROUPS))


def _pack(units: _Units, streamed: Sequence[int], sizes: Sequence[int],
          group_bytes: int) -> list[list[int]]:
    """Units packed into groups of at most `group_bytes` (a unit larger than that is a
    group of its own), in *reverse* leaf order.

    Why reversed: a model written forward (embedding, layers, head, as Equinox modules
    and their pytrees are) gets its gradients last leaf first from the backward pass.
    Groups taken in that order can be updated while the backward pass goes on, each as
    soon as its gradients exist, so every gradient and activation is freed early. In
    leaf order the first group waits for the very last gradient, and XLA keeps the
    backward pass's activations alive until the update of the later layers: in the GPU
    plan of an activation-heavy MLP (H200, `tests/test_plan.py`) that costs 100 MiB
    (357 MiB at the peak instead of 256 MiB; 292 MiB without offload). The order of
    the groups changes nothing in the results: each equation computes what it did."""
    members: dict[int, list[int]] = {}
    for i in streamed:
        members.setdefault(units.uf.find(i), []).append(i)
    groups: list[list[int]] = []
    group_size = 0
    for unit in sorted(members.values(), key=min, reverse=True):
        size = sum(sizes[i] for i in unit)
        if groups and group_size + size <= group_bytes:
            groups[-1].extend(unit)
            group_size += size
        else:
            groups.append(list(unit))
            group_size = size
    return groups


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


@dataclasses.dataclass
class _Schedule:
    plan: StreamPlan
    stages: list[list[Any]]  # equations per stage (0: prologue, g >= 1: group g)
    group_invars: list[list[Any]]  # per stage: the state variables it brings in
    host_outputs: set[int]  # indices of the jaxpr outputs that go back to host


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
    groups = _pack(units, streamed, sizes, int(group_bytes))
    group_of_leaf = {i: g + 1 for g, members in enumerate(groups) for i in members}
    stages = _stages(jaxpr, units, group_of_leaf, len(groups))

    read = {v for eqn in jaxpr.eqns for v in eqn.invars if is_var(v)}
    group_invars: list[list[Any]] = [[state_invars[i] for i in prologue if state_invars[i] in read]]
    group_invars += [[state_invars[i] for i in sorted(g) if state_invars[i] in read] for g in groups]
    paths = traced.state_paths
    plan = StreamPlan(
        groups=tuple(tuple(paths[i] for i in sorted(g)) for g in groups),
        group_nbytes=tuple(sum(sizes[i] for i in g) for g in groups),
        prologue=tuple(paths[i] for i in prologue),
        resident=tuple(p for p, off in zip(paths, offloaded, strict=True) if not off),
    )
    host_outputs = {traced.n_updates_out + i for i, off in enumerate(offloaded) if off}
    return _Schedule(plan, stages, group_invars, host_outputs)


# ----------------------------------------------------------------------------------------
# Running the schedule


def _run(traced: TracedUpdate, schedule: _Schedule, options: Options,
         init_dtypes: Sequence[Any]) -> list[Any]:
    """The flat outputs of the update, evaluated stage by stage."""
    jaxpr = traced.jaxpr
    env = Env()
    env.write(jaxpr.constvars, traced.consts)
    env.write(jaxpr.invars, traced.flat_args)
    dtype_of = dict(zip(jaxpr.invars[traced.state_slice], init_dtypes, strict=True))
    stage_of_output: dict[Any, int] = {}
    for stage, eqns in enumerate(schedule.stages):
        for eqn in eqns:
            for o in eqn.outvars:
                stage_of_output.setdefault(o, stage)
    outputs_of: dict[int, list[int]] = {}
    for k, v in enumerate(jaxpr.outvars):
        if is_var(v) and v in stage_of_output:
            outputs_of.setdefault(stage_of_output[v], []).append(k)
    done: dict[int, Any] = {}  # output index -> value
    fences: list[list[int]] = []  # per stage run: the outputs later groups wait for
    computed: list[Any] = []  # the last group's new state, on the device

    for stage, eqns in enumerate(schedule.stages):
        if stage > 0 and not eqns:
            continue
        incoming = schedule.group_invars[stage]
        waits_for = fences[-1 - options.lookahead] if len(fences) > options.lookahead else []
        after = computed if incoming else []
        if waits_for or after:
            # The barrier: this group's state (still on host) waits for the new state
            # of the group `lookahead + 1` before it, already sent to host, and for the
            # new state of the group before it on the device (it only orders the copy).
            # Updates are not fenced: XLA then fuses them into their consumer
            # (typically `apply_updates`, in place). Fenced, they would all be
            # materialised and live until the end: on an H200, 1216 MiB at the peak
            # instead of 256 MiB (16 x 64 MiB params, Adam; bench/gpu_peak.py).
            fenced, state, _ = jax.lax.optimization_barrier(
                ([done[k] for k in waits_for], env.read_all(incoming), after)
            )
            done.update(zip(waits_for, fenced, strict=True))
            env.write(incoming, state)
        env.write(incoming, options.fetch(env.read_all(incoming), [dtype_of[v] for v in incoming]))
        env.run(eqns)
        produced = outputs_of.get(stage, [])
        done.update((k, env.read(jaxpr.outvars[k])) for k in produced)
        to_host = [k for k in produced if k in schedule.host_outputs]
        computed = [done[k] for k in to_host] or computed
        done.update(zip(to_host, options.store([done[k] for k in to_host], True, "pinned_host"),
                        strict=True))
        # What a later group waits for: this group's state on host; for a group whose
        # state is only read, its updates.
        fences.append(to_host if to_host or stage == 0 else produced)

    # Outputs no stage produced: literals, and inputs or constants returned as they are.
    return [done[k] if k in done else env.read(v) for k, v in enumerate(jaxpr.outvars)]


def _trace_streamable(inner: Any, updates: Any, inner_state: Any, params: Any,
                      extra_args: dict[str, Any],
                      state_dtypes: Optional[Sequence[Any]] = None) -> TracedUpdate:
    traced = trace_update(inner, updates, inner_state, params, extra_args, state_dtypes)
    if traced.jaxpr.effects:
        raise CompositionError(
            "offloaded(..., group_bytes=...): the inner update has side effects "
            f"({', '.join(sorted(map(str, traced.jaxpr.effects)))}), e.g. a callback or "
            "`jax.debug.print`; streaming reorders its operations, so it is not done. "
            "Use group_bytes=None."
        )
    out_state: Any = jtu.tree_structure(traced.rebuild(
        [v.aval for v in traced.jaxpr.outvars])[1])  # PyTreeDef: typed without __eq__
    in_state: Any = jtu.tree_structure(inner_state)
    if out_state != in_state:
        raise CompositionError(
            "offloaded(..., group_bytes=...): the inner transformation returns a state "
            "whose structure differs from that of the state it was given, so new "
            "state leaves cannot be matched to old ones. Use group_bytes=None."
        )
    return traced


def streamed_update(
    inner: Any, options: Options, updates: Any, inner_state: Any, params: Any,
    extra_args: dict[str, Any], init_dtypes: Sequence[Any],
) -> tuple[Any, Any]:
    """The update strategy of `group_bytes=N`: `inner.update` with the offloaded state
    brought to the device group by group. Returns the updates and the new inner state
    with its offloaded leaves back in (pinned) host memory."""
    arrays = [(x, d) for x, d in zip(jtu.tree_leaves(inner_state), init_dtypes, strict=True)
              if eqx.is_array(x)]
    traced = _trace_streamable(inner, updates, inner_state, params, extra_args,
                               [options.widened_dtype(x.dtype, d) for x, d in arrays])
    assert options.group_bytes is not None
    schedule = _schedule(traced, options.group_bytes)  # may raise CompositionError
    return traced.rebuild(_run(traced, schedule, options, [d for _, d in arrays]))


def stream_plan(
    inner: Any,
    updates: Any,
    inner_state: Any,
    params: Any = None,
    *,
    group_bytes: Union[int, str] = "auto",
    **extra_args: Any,
) -> StreamPlan:
    """The groups that `offloaded(inner, group_bytes=group_bytes)` streams for these
    arguments (it traces `inner.update` abstractly; nothing is computed).

    **Arguments:**

    - `inner`: the inner `optax.GradientTransformation` (not the `offloaded` one).
    - `updates`, `params`, `**extra_args`: as for `update` (arrays or
        `jax.ShapeDtypeStruct`s are both fine for `updates` and `params`).
    - `inner_state`: the inner state as it is between steps, i.e.
        `offloaded(...).init(params).inner_state`: leaves in host memory are streamed.
    - `group_bytes`: as for `offloaded` (default `"auto"`, as `offloaded`'s default).

    **Returns:**

    A `StreamPlan`.

    **Raises:**

    `CompositionError` if the update cannot be streamed (see `offloaded`).

    !!! Example

        ```python
        import jax.numpy as jnp
        import optax
        import eqx_offload

        params = {"a": jnp.ones((256, 256)), "b": jnp.ones((256, 256))}
        opt = eqx_offload.offloaded(optax.adam(1e-3), group_bytes=1 << 19)
        state = opt.init(params)
        plan = eqx_offload.stream_plan(
            optax.adam(1e-3), params, state.inner_state, group_bytes=1 << 19
        )
        assert len(plan.groups) == 2  # mu and nu of "a", then of "b"
        ```
    """
    inner = optax.with_extra_args_support(inner)
    traced = _trace_streamable(inner, updates, inner_state, params, extra_args)
    return _schedule(traced, group_bytes).plan

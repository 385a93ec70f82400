"""The streamed update (`offloaded(..., group_bytes=N)`) and the host-compute update
(`offloaded(..., compute="host")`).

**Streamed update.** The default `offloaded` update brings the whole optimizer state to
the device, so the device needs room for all of it at the peak of the step. The
streamed update brings it one group of leaves at a time: group 1 in, update, group 1 out,
group 2 in, ... so the state's share of peak device memory is the largest group.

How the groups are found, and why the result stays bitwise equal: `inner.update` is
traced once to a jaxpr (its program of primitive operations). A dependency analysis on
that jaxpr finds which offloaded state leaves are read together by some operation (Adam's
`mu` and `nu` of one parameter are); those leaves form an indivisible *unit*. Units are
packed in leaf order into groups of at most `group_bytes`. The jaxpr's own equations are
then evaluated stage by stage: each equation runs in the stage of the group it depends
on, and equations that depend on no offloaded state (gradient clipping by global norm,
schedules, bias-correction scalars) run in the stage of their first consumer. The
streamed program is made of exactly the equations of `inner.update`, so its results are
those of `inner.update` by construction: nothing is re-derived per group, no optimizer is
re-initialised per group, and no per-transformation allowlist can drift out of date.

The order is enforced with data dependencies XLA must respect: the state of group `g`,
still on host, passes through one `jax.lax.optimization_barrier` together with the new
state of group `g - 1`, already sent to host. XLA cannot start moving group `g` to the
device before group `g - 1` is back on host, nor merge the groups. Device values
(gradients, the updates, scalars) are not fenced, so XLA sees the data flow of the
unwrapped update and fuses the updates into their consumer (`apply_updates`).

What is rejected (`CompositionError`, at the first `update`, i.e. when the step is traced):
an update that couples the state of several parameters so that no group boundary can be
drawn between them, e.g. `optax.apply_if_finite` (keeps or drops the whole new state
depending on all updates), `optax.MultiSteps` (a `lax.cond` over the whole state) or a
global statistic computed *after* a stateful transformation
(`chain(adam, clip_by_global_norm)`). The error names the coupling operation and where it
was made. Global statistics of gradients (`chain(clip_by_global_norm, adam)`) need no
state and are computed in the first stage that uses them.

**Host-compute update.** `compute="host"` runs `inner.update` on the host CPU with
`jax.experimental.compute_on.compute_on("device_host")`: the state never reaches the
device; gradients (and parameters, if the transformation reads them) go to host and the
updates come back.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, Optional

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.extend.source_info_util as source_info_util
import jax.tree_util as jtu
import numpy as np

from ._compat import host_compute, JAXPR_TYPES
from ._errors import CompositionError
from ._move import move
from ._where import is_traced, leaf_mask, nbytes, path_to_str


Compute = Literal["device", "host"]
"""Where `offloaded` runs the inner update: `"device"` (default) or `"host"`."""

_HOST_KINDS = ("pinned_host", "unpinned_host")


def check_options(group_bytes: object, compute: object) -> None:
    """Validate the `group_bytes` and `compute` arguments of `offloaded`."""
    if compute not in ("device", "host"):
        raise ValueError(f"offloaded(compute={compute!r}): compute must be 'device' or 'host'.")
    if group_bytes is None:
        return
    if isinstance(group_bytes, bool) or not isinstance(group_bytes, (int, np.integer)):
        raise TypeError(
            f"offloaded(group_bytes={group_bytes!r}): group_bytes must be an int (bytes "
            "of optimizer state per group) or None (no streaming)."
        )
    if group_bytes < 0:
        raise ValueError(f"offloaded(group_bytes={group_bytes}): group_bytes must be >= 0.")
    if compute == "host":
        raise ValueError(
            "offloaded(group_bytes=..., compute='host'): the two modes exclude each "
            "other. With compute='host' the state never reaches the device, so there is "
            "nothing to stream; pass one of them."
        )


def _is_host(leaf: Any) -> bool:
    if is_traced(leaf):
        return bool(jax.typeof(leaf).memory_space == jax.memory.Space.Host)
    if isinstance(leaf, jax.Array):
        return leaf.sharding.memory_kind in _HOST_KINDS
    return False


def _spec(leaf: Any) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(leaf)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


# ----------------------------------------------------------------------------------------
# Tracing `inner.update` to one flat jaxpr


@dataclasses.dataclass
class _Traced:
    jaxpr: Any  # jax.extend.core.Jaxpr
    consts: list[Any]
    flat_args: list[Any]
    state_paths: list[str]  # paths of the state's array leaves, in flat order
    state_offset: int  # index of the first state leaf in `flat_args`
    n_updates_out: int
    out_treedef: Any
    out_static: Any


def _inlinable(eqn: Any) -> bool:
    """A nested `jit` with no placement of its own: XLA inlines it anyway, and inlining
    it here lets the analysis see through it (`jnp.where` is one)."""
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


def _bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Evaluate one equation on `invals`, as `jax.core.eval_jaxpr` does."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        ans = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(ans) if eqn.primitive.multiple_results else [ans]


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if isinstance(v, jex.Literal) else env[v]


def _eval_inlined(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        if _inlinable(eqn):
            inner = eqn.params["jaxpr"]
            outs = _eval_inlined(inner.jaxpr, inner.consts, invals)
        else:
            outs = _bind(eqn, invals)
        env.update(zip(eqn.outvars, outs))
    return [_read(env, v) for v in jaxpr.outvars]


def _trace(
    inner: Any, updates: Any, inner_state: Any, params: Any, extra_args: dict[str, Any]
) -> _Traced:
    parts = (updates, inner_state, params, extra_args)
    dynamic, static = eqx.partition(parts, eqx.is_array)
    flat, in_treedef = jtu.tree_flatten(dynamic)
    state_keyed = jtu.tree_flatten_with_path(dynamic[1])[0]
    state_offset = len(jtu.tree_leaves(dynamic[0]))
    out_static: list[Any] = []

    def run(*leaves: Any) -> Any:
        u, s, p, e = eqx.combine(jtu.tree_unflatten(in_treedef, leaves), static)
        out = inner.update(u, s, p, **e)
        dyn_out, static_out = eqx.partition(out, eqx.is_array)
        out_static[:] = [static_out]
        return dyn_out

    specs = [_spec(x) for x in flat]
    closed, out_shape = jax.make_jaxpr(run, return_shape=True)(*specs)
    if any(_inlinable(e) for e in closed.jaxpr.eqns):
        flat_closed = closed
        closed = jax.make_jaxpr(
            lambda *a: _eval_inlined(flat_closed.jaxpr, flat_closed.consts, a)
        )(*specs)
    out_leaves, out_treedef = jtu.tree_flatten(out_shape)
    n_updates_out = len(jtu.tree_leaves(out_shape[0]))
    out_state_def: Any = jtu.tree_structure(out_shape[1])  # PyTreeDef: typed without __eq__
    if out_state_def != jtu.tree_structure(dynamic[1]):
        raise CompositionError(
            "offloaded(..., group_bytes=...): the inner transformation returns a state "
            "whose array leaves do not match those of the state it was given, so new "
            "state leaves cannot be matched to old ones. Use group_bytes=None."
        )
    del out_leaves
    return _Traced(
        jaxpr=closed.jaxpr,
        consts=list(closed.consts),
        flat_args=flat,
        state_paths=[path_to_str(p) for p, _ in state_keyed],
        state_offset=state_offset,
        n_updates_out=n_updates_out,
        out_treedef=out_treedef,
        out_static=out_static[0],
    )


# ----------------------------------------------------------------------------------------
# The plan: units, groups, and the stage of every equation


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """How `offloaded(inner, group_bytes=N)` streams a state through the device.

    **Fields:**

    - `groups`: for each group, in the order the update runs them, the paths (as in
        `eqx_offload.pattern`, relative to the inner state) of its state leaves.
    - `group_nbytes`: the bytes of state each group brings to the device.
    - `prologue`: offloaded 0-d leaves (e.g. a step counter, when `where` selects it);
        every group reads them, so they come to the device once, before the first group.
    - `resident`: state leaves that stay on the device (not selected by `where`).

    The state's share of peak device memory during the update is `max(group_nbytes)`
    plus the prologue, instead of the whole offloaded state.
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


def _where_made(eqn: Any) -> str:
    return f"`{eqn.primitive.name}` at {source_info_util.summarize(eqn.source_info)}"


@dataclasses.dataclass
class _Schedule:
    plan: StreamPlan
    stage_eqns: list[list[int]]  # per stage (0: prologue, g >= 1: group g), in order
    group_of_leaf: dict[int, int]  # state leaf index -> group (streamed leaves)
    prologue_leaves: list[int]  # state leaf indices
    offloaded: list[bool]  # per state leaf


def _schedule(traced: _Traced, group_bytes: int) -> _Schedule:
    jaxpr = traced.jaxpr
    eqns = jaxpr.eqns
    n_state = len(traced.state_paths)
    state_leaves = traced.flat_args[traced.state_offset : traced.state_offset + n_state]
    offloaded = [_is_host(x) for x in state_leaves]
    streamed = [i for i in range(n_state) if offloaded[i] and np.ndim(state_leaves[i]) > 0]
    prologue = [i for i in range(n_state) if offloaded[i] and np.ndim(state_leaves[i]) == 0]
    state_invars = jaxpr.invars[traced.state_offset : traced.state_offset + n_state]

    # 1. Which streamed leaves are read together: union-find over the dependencies.
    uf = _UnionFind(n_state)
    dep: dict[Any, int] = {state_invars[i]: i for i in streamed}
    merges: list[tuple[Any, list[int]]] = []
    eqn_unit: list[Optional[int]] = []
    for eqn in eqns:
        roots = sorted(
            {uf.find(dep[v]) for v in eqn.invars if not isinstance(v, jex.Literal) and v in dep}
        )
        if len(roots) > 1:
            merges.append((eqn, roots))
            unit: Optional[int] = uf.union(roots)
        else:
            unit = roots[0] if roots else None
        eqn_unit.append(unit)
        if unit is not None:
            for o in eqn.outvars:
                dep[o] = unit

    # 2. A unit that produces the updates of more than one parameter couples them.
    produces: dict[int, list[int]] = {}
    for k, v in enumerate(jaxpr.outvars[: traced.n_updates_out]):
        if not isinstance(v, jex.Literal) and v in dep:
            produces.setdefault(uf.find(dep[v]), []).append(k)
    for root, outs in produces.items():
        if len(outs) > 1:
            coupled = [traced.state_paths[i] for i in streamed if uf.find(i) == root]
            reason = next((eqn for eqn, roots in merges if uf.find(roots[0]) == root), None)
            shown = ", ".join(coupled[:4]) + (", ..." if len(coupled) > 4 else "")
            raise CompositionError(
                "offloaded(..., group_bytes=...): this optimizer's update cannot be "
                f"streamed. It couples the state of {len(outs)} parameters (state "
                f"leaves {shown}): no group boundary can be drawn between them"
                + (f"; the coupling is made by {_where_made(reason)}" if reason else "")
                + ". Transformations that combine all of the new state (e.g. "
                "`optax.apply_if_finite`, `optax.MultiSteps`, or a global norm taken "
                "after a stateful transformation as in `chain(adam, "
                "clip_by_global_norm)`) need the whole state on the device at once. "
                "Put global gradient transformations before the stateful ones "
                "(`chain(clip_by_global_norm(...), adam(...))` streams), or use "
                "group_bytes=None."
            )

    # 3. Pack units, in leaf order, into groups of at most `group_bytes`.
    units: dict[int, list[int]] = {}
    for i in streamed:
        units.setdefault(uf.find(i), []).append(i)
    groups: list[list[int]] = []
    sizes: list[int] = []
    for members in sorted(units.values(), key=min):
        size = sum(nbytes(state_leaves[i]) for i in members)
        if groups and sizes[-1] + size <= group_bytes:
            groups[-1].extend(members)
            sizes[-1] += size
        else:
            groups.append(list(members))
            sizes.append(size)
    group_of_leaf = {i: g + 1 for g, members in enumerate(groups) for i in members}

    # 4. The stage of every equation: its group's if it reads offloaded state; else
    # (gradient clipping, schedules, bias corrections) that of its first consumer, or 0.
    # Only the order of tracing follows from this: such equations read device values,
    # which pass through no barrier, so XLA sees the same data flow as in the unwrapped
    # update and optimises it the same way (its algebraic rewrites depend on the
    # surrounding program, and results stay bitwise equal only if that is unchanged).
    inf = len(groups) + 1
    first_use: dict[Any, int] = {v: 0 for v in jaxpr.outvars if not isinstance(v, jex.Literal)}
    eqn_stage = [0] * len(eqns)
    for j in reversed(range(len(eqns))):
        eqn = eqns[j]
        unit = eqn_unit[j]
        if unit is not None:
            stage = group_of_leaf[uf.find(unit)]
        else:
            stage = min((first_use.get(o, inf) for o in eqn.outvars), default=inf)
            stage = 0 if stage == inf else stage
        eqn_stage[j] = stage
        for v in eqn.invars:
            if not isinstance(v, jex.Literal):
                first_use[v] = min(first_use.get(v, inf), stage)
    stage_eqns: list[list[int]] = [[] for _ in range(len(groups) + 1)]
    for j, stage in enumerate(eqn_stage):
        stage_eqns[stage].append(j)

    paths = traced.state_paths
    plan = StreamPlan(
        groups=tuple(tuple(paths[i] for i in sorted(g)) for g in groups),
        group_nbytes=tuple(sizes),
        prologue=tuple(paths[i] for i in prologue),
        resident=tuple(paths[i] for i in range(n_state) if not offloaded[i]),
    )
    return _Schedule(plan, stage_eqns, group_of_leaf, prologue, offloaded)


# ----------------------------------------------------------------------------------------
# Running the schedule


def _run(traced: _Traced, schedule: _Schedule, memory_kind: str) -> tuple[Any, Any]:
    jaxpr = traced.jaxpr
    eqns = jaxpr.eqns
    n_state = len(traced.state_paths)
    state_invars = jaxpr.invars[traced.state_offset : traced.state_offset + n_state]
    group_invars: dict[Any, int] = {state_invars[i]: g for i, g in schedule.group_of_leaf.items()}
    raw: dict[Any, Any] = dict(zip(jaxpr.invars, traced.flat_args))
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, traced.consts))
    env.update(raw)

    # Which stage produces each output, and which outputs go to host.
    out_stage: dict[Any, int] = {}
    for stage, js in enumerate(schedule.stage_eqns):
        for j in js:
            for o in eqns[j].outvars:
                out_stage.setdefault(o, stage)
    to_host_out = {traced.n_updates_out + i for i in range(n_state) if schedule.offloaded[i]}
    outs_of_stage: dict[int, list[int]] = {}
    for k, v in enumerate(jaxpr.outvars):
        if not isinstance(v, jex.Literal) and v in out_stage:
            outs_of_stage.setdefault(out_stage[v], []).append(k)
    out_val: dict[int, Any] = {}

    def run_stage(stage: int, barrier_with: list[int]) -> list[int]:
        js = schedule.stage_eqns[stage]
        read = {v for j in js for v in eqns[j].invars if not isinstance(v, jex.Literal)}
        if stage > 0:
            # The barrier: this group's state (still on host) waits for the previous
            # group's new state, already sent to host. The previous group's updates are
            # not fenced: XLA then fuses them into whatever consumes them (typically
            # `apply_updates`, in place). Fenced, they would all be materialised and
            # live until the end: on an H200, 1216 MiB at the peak instead of 256 MiB
            # (16 x 64 MiB params, Adam; bench/gpu_peak.py).
            incoming = [v for v, g in group_invars.items() if g == stage and v in read]
            carried, state = jax.lax.optimization_barrier(
                ([out_val[k] for k in barrier_with], [env[v] for v in incoming])
            )
            out_val.update(zip(barrier_with, carried))
            env.update(zip(incoming, state))
        else:
            # Offloaded scalars: every group may read them, so they come in first.
            anywhere = {v for e in eqns for v in e.invars if not isinstance(v, jex.Literal)}
            incoming = [state_invars[i] for i in schedule.prologue_leaves]
            incoming = [v for v in incoming if v in anywhere]
        env.update(zip(incoming, move([env[v] for v in incoming], True, None, "to_device")))
        for j in js:
            eqn = eqns[j]
            env.update(zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars])))
        keys = outs_of_stage.get(stage, [])
        for k in keys:
            out_val[k] = env[jaxpr.outvars[k]]
        host = [k for k in keys if k in to_host_out]
        if host:
            moved = move([out_val[k] for k in host], True, memory_kind, "memory_kind")
            out_val.update(zip(host, moved))
        if host or stage == 0:
            return host
        return keys  # a group whose state is only read: fence its updates instead

    carried = run_stage(0, [])
    for stage in range(1, len(schedule.stage_eqns)):
        if schedule.stage_eqns[stage]:
            carried = run_stage(stage, carried)

    flat_out = []
    for k, v in enumerate(jaxpr.outvars):
        if k in out_val:
            flat_out.append(out_val[k])
        elif isinstance(v, jex.Literal):
            flat_out.append(v.val)
        else:  # an input or a constant returned as is
            flat_out.append(raw[v] if v in raw else env[v])
    dyn_updates, dyn_state = jtu.tree_unflatten(traced.out_treedef, flat_out)
    updates, state = eqx.combine((dyn_updates, dyn_state), traced.out_static)
    return updates, state


def _check_effects(traced: _Traced) -> None:
    if traced.jaxpr.effects:
        raise CompositionError(
            "offloaded(..., group_bytes=...): the inner update has side effects "
            f"({', '.join(sorted(map(str, traced.jaxpr.effects)))}), e.g. a callback or "
            "`jax.debug.print`; streaming reorders its operations, so it is not done. "
            "Use group_bytes=None."
        )


def streamed_update(
    inner: Any,
    updates: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
    *,
    group_bytes: int,
    memory_kind: str,
) -> tuple[Any, Any]:
    """`inner.update`, with the offloaded state brought to the device one group at a
    time. Returns the updates and the new inner state (offloaded leaves in host memory).

    Streaming is a property of one compiled program, so an eager call (no argument
    traced) is compiled: op-by-op execution would bound nothing. Its results are then
    those of `jax.jit(inner.update)`.
    """
    leaves = jtu.tree_leaves((updates, inner_state, params, extra_args))
    if not any(is_traced(x) for x in leaves):
        return _streamed_jit(inner, updates, inner_state, params, extra_args, group_bytes)
    return _streamed(inner, updates, inner_state, params, extra_args, group_bytes, memory_kind)


def _streamed(
    inner: Any,
    updates: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
    group_bytes: int,
    memory_kind: str,
) -> tuple[Any, Any]:
    traced = _trace(inner, updates, inner_state, params, extra_args)
    _check_effects(traced)
    schedule = _schedule(traced, group_bytes)
    return _run(traced, schedule, memory_kind)


@eqx.filter_jit
def _streamed_jit(
    inner: Any,
    updates: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
    group_bytes: int,
) -> tuple[Any, Any]:
    # Under `jit` only pinned_host is reachable; `offloaded` moves the new state on to
    # `unpinned_host` afterwards, eagerly, if that is its memory kind.
    return _streamed(inner, updates, inner_state, params, extra_args, group_bytes, "pinned_host")


def stream_plan(
    inner: Any,
    updates: Any,
    inner_state: Any,
    params: Any = None,
    *,
    group_bytes: int,
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
    - `group_bytes`: as for `offloaded`.

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
    import optax

    inner = optax.with_extra_args_support(inner)
    traced = _trace(inner, updates, inner_state, params, extra_args)
    _check_effects(traced)
    return _schedule(traced, group_bytes).plan


# ----------------------------------------------------------------------------------------
# Host compute


def _has_subprogram(eqn: Any) -> bool:
    def is_program(x: Any) -> bool:
        return isinstance(x, JAXPR_TYPES) or (
            isinstance(x, (tuple, list)) and any(is_program(y) for y in x)
        )

    return any(is_program(v) for v in eqn.params.values())


def _eval_on_host(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluate `jaxpr` (traced for device memory) on host-memory arguments.

    JAX types memory spaces: an operation's array operands must all be in one memory,
    and arrays an update creates itself (`jnp.where(c, x, 0.0)` broadcasts `0.0`) are
    typed for device memory. Inside `compute_on("device_host")` everything lives on the
    host, so such arrays are retyped to host memory where they meet host operands.
    """
    host = jax.memory.Space.Host
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        spaces = [jax.typeof(x).memory_space if np.ndim(x) else None for x in invals]
        if host in spaces:
            if _has_subprogram(eqn):
                raise CompositionError(
                    "offloaded(..., compute='host'): the update contains "
                    f"{_where_made(eqn)}, a control-flow or call primitive whose body "
                    "was traced for device memory; JAX (0.10) cannot run it on "
                    "host-memory operands. Combinators that branch on the state "
                    "(`optax.MultiSteps`, `optax.apply_if_finite`) are among these. "
                    "Use compute='device' (the default) for this optimizer."
                )
            invals = [
                jax.device_put(x, host) if s is not None and s != host else x
                for x, s in zip(invals, spaces)
            ]
        env.update(zip(eqn.outvars, _bind(eqn, invals)))
    return [_read(env, v) for v in jaxpr.outvars]


def host_update(
    inner: Any,
    updates: Any,
    inner_state: Any,
    params: Any,
    extra_args: dict[str, Any],
    *,
    where: Any,
    memory_kind: str,
) -> tuple[Any, Any]:
    """`inner.update` run on the host with `compute_on("device_host")`. Returns the
    updates in device memory and the new inner state with the leaves selected by `where`
    in `memory_kind` and the others in device memory."""
    traced = _trace(inner, updates, inner_state, params, extra_args)
    # Only what the update reads goes to host (Adam never reads the parameters).
    read = {v for e in traced.jaxpr.eqns for v in e.invars if not isinstance(v, jex.Literal)}
    read |= {v for v in traced.jaxpr.outvars if not isinstance(v, jex.Literal)}
    used = [i for i, v in enumerate(traced.jaxpr.invars) if v in read]
    args = list(traced.flat_args)
    moved = move([args[i] for i in used], True, "pinned_host", "compute='host'")
    for i, x in zip(used, moved):
        args[i] = x

    def run(*leaves: Any) -> list[Any]:
        return _eval_on_host(traced.jaxpr, traced.consts, leaves)

    # Where each output goes: updates to the device, state leaves that `where` selects to
    # host, the others (step counters) to the device.
    state_leaves = jtu.tree_leaves(inner_state)
    keep = [m for x, m in zip(state_leaves, leaf_mask(inner_state, where)) if eqx.is_array(x)]
    device, host = jax.memory.Space.Device, jax.memory.Space.Host
    spaces = [device] * traced.n_updates_out + [host if m else device for m in keep]
    on_host: Callable[..., list[Any]] = host_compute(
        run, compute_type="device_host", out_memory_spaces=spaces
    )
    flat_out = on_host(*args)
    dyn_updates, dyn_state = jtu.tree_unflatten(traced.out_treedef, flat_out)
    new_updates, new_state = eqx.combine((dyn_updates, dyn_state), traced.out_static)
    new_updates = move(new_updates, True, None, "to_device")
    selected = leaf_mask(new_state, where)
    treedef = jtu.tree_structure(new_state)
    new_state = move(new_state, jtu.tree_unflatten(treedef, selected), memory_kind, "memory_kind")
    others = jtu.tree_unflatten(treedef, [not s for s in selected])
    new_state = move(new_state, others, None, "to_device")
    return new_updates, new_state


# ----------------------------------------------------------------------------------------
# For the benchmark and bench/gpu_peak.py

BENCH_MODES: tuple[str, ...] = ("streamed", "host_compute")
"""The benchmark columns this module adds, next to `baseline`, `manual` and
`eqx_offload`."""


def bench_transformation(mode: str, optimizer: Any) -> Any:
    """The transformation that the benchmark column `mode` measures.

    - `"streamed"`: `offloaded(optimizer, group_bytes=0)`: one parameter's state on the
        device at a time, the finest grouping, which shows the bound most clearly.
    - `"host_compute"`: `offloaded(optimizer, compute="host")`.

    Used by `eqx_offload/_bench.py` and `bench/gpu_peak.py`, so that both measure the
    same thing.
    """
    from ._optax import offloaded  # here, because _optax imports this module

    if mode == "streamed":
        return offloaded(optimizer, group_bytes=0)
    if mode == "host_compute":
        return offloaded(optimizer, compute="host")
    raise ValueError(f"bench_transformation: mode {mode!r} is not one of {BENCH_MODES}.")

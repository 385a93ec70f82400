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

Stacked layers (`eqx.filter_vmap` over a layer: one `(layers, d_in, d_out)` leaf for
all of them): a unit of leaves with at least 3 dimensions whose update is elementwise
along their leading axis (`_sliceable`, decided on the jaxpr) and that is larger than a
group is split into pieces of whole rows (`_pack`). A piece reads its rows of each
host buffer, runs the unit's equations on them (`_piece_eqns`), and writes its new rows
back into that buffer, in place (`dynamic_update_slice`); its rows of the update go into
the gradient's buffer (`_tails`). The same equations on the same rows: the results stay
bitwise.

What cannot be streamed (with `group_bytes=N`, a `CompositionError` when the update is
first traced; with `"auto"`, the whole state comes to the device at once instead): an update that
couples the state of several parameters so that no group boundary can be drawn between
them, e.g. `optax.apply_if_finite`, `optax.MultiSteps` or a global statistic computed
*after* a stateful transformation (`chain(adam, clip_by_global_norm)`); and an update
with side effects (callbacks), which streaming would reorder.

The analysis (units, groups, pieces, the stage of every equation) is `schedule`'s, on
the jaxpr alone; this module runs the schedule it returns.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._core.compat import optimization_barrier
from .._core.errors import NotStreamable
from .._core.inner import as_transformation
from .._core.move import move
from .._core.placement import is_host, memory_kind_of
from .._optim.layout import fetch, narrowed, store, widened_dtype
from .._optim.options import Options
from .jaxpr import bind, Env, is_var, trace_update, TracedUpdate
from .schedule import _converts_only, _Piece, _Schedule, _schedule, StreamPlan


# ----------------------------------------------------------------------------------------
# Running the schedule


def _outputs_by_stage(jaxpr: Any, stages: list[list[Any]]) -> dict[int, list[int]]:
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


@dataclasses.dataclass
class _Runner:
    """One evaluation of a schedule, run by run (`_run`; run `j` is stage `runs[j]`, the
    stages with something to do): the jaxpr's environment, the values made along the
    way, and what later runs wait for.

    Values are kept in `vals` under keys: `("out", k)` the jaxpr's output `k`;
    `("leaf", i)` the host buffer of state leaf `i` of a split unit, as its pieces come
    back into it (one `dynamic_update_slice` each, in place); `("read", j, root, index,
    i)` a piece's rows of leaf `i`, on the device; `("upd", k, index)` a piece's rows of
    update `k`; `("acc", k)` the gradient buffer a split unit's update `k` is written
    into (`into`)."""

    traced: TracedUpdate
    schedule: _Schedule
    options: Options
    env: Env
    dtype_of: dict[Any, Any]  # state variable -> the dtype of its leaf between steps
    runs: list[int]  # the stages that run, in order
    outputs_of: dict[int, list[int]]  # stage -> the jaxpr outputs its equations make
    sliced_leaves: set[int]  # the state leaves split units write back row by row
    vals: dict[Any, Any] = dataclasses.field(default_factory=dict)
    # update k of a split unit -> (what its pieces write into its gradient's buffer, the
    # equations after that; see `_into_gradients`)
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
    def start(cls, traced: TracedUpdate, schedule: _Schedule, options: Options,
              init_dtypes: Sequence[Any]) -> "_Runner":
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
        runner = cls(traced, schedule, options, env, dict(zip(state_invars, init_dtypes, strict=True)),
                     runs, _outputs_by_stage(jaxpr, schedule.stages), sliced_leaves)
        for i in sliced_leaves.union(*(unit.read for unit in schedule.sliced.values())):
            runner.vals[("leaf", i)] = env.read(state_invars[i])
        runner._into_gradients()
        return runner

    def _into_gradients(self) -> None:
        """Where a split unit's updates go: update `k` is written row by row into the
        buffer of the gradient it is computed from (`_tails`; each piece reads its rows
        of the gradient before writing them, and the pieces cover every row), if that
        gradient is on the device and of the same type as what is written. A gradient
        in host memory (of a weight kept there) takes the update's rows in host memory
        instead (`into_host`), where the update is of the gradient's type and made
        from the `_tails` cut by dtype conversions alone (`master_weights`' new compute
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
                elif on_host and _converts_only(tail) and (
                        gradient.aval.shape, gradient.aval.dtype) == (
                        self.jaxpr.outvars[k].aval.shape, self.jaxpr.outvars[k].aval.dtype):
                    self.into_host.add(k)
                else:
                    continue
                self.source_of.setdefault(root, {})[gradient] = k
                self.vals[("acc", k)] = self.env.read(gradient)

    def fetch(self, j: int) -> None:
        """Bring run `j`'s state to the device: after the state of run `j - 1 -
        lookahead` is back on host, and nothing else (traced as soon as that is known,
        so a split leaf's later pieces are read before its earlier ones are written)."""
        schedule, vals, env = self.schedule, self.vals, self.env
        stage = self.runs[j]
        incoming = schedule.group_invars[stage]
        lookahead = self.options.lookahead
        waits_for = self.fences[j - 1 - lookahead] if j > lookahead else []
        leaves = sorted({i for p in schedule.pieces[stage]
                         for i in schedule.sliced[p.root].read})
        # (with the host buffers the pieces read from: read after the barrier)
        keys = list(dict.fromkeys(
            [*waits_for, *(("leaf", i) for i in leaves)])) if waits_for else []
        after = list(self.latest) if incoming or keys else []
        if keys or after:
            # The barrier: this group's state (still on host) waits for the new state
            # of the group `lookahead + 1` before it, already sent to host, and for the
            # new state of the last group run, on the device (it only orders the copy).
            # Updates are not fenced: XLA then fuses them into their consumer
            # (typically `apply_updates`, in place). Fenced, they would all be
            # materialised and live until the end: on an H200, 1216 MiB at the peak
            # instead of 256 MiB (16 x 64 MiB params, Adam; bench/gpu_peak.py).
            fenced, state, _ = optimization_barrier(
                ([vals[k] for k in keys], env.read_all(incoming), after)
            )
            vals.update(zip(keys, fenced, strict=True))
            env.write(incoming, state)
        env.write(incoming, fetch(self.options, env.read_all(incoming),
                                        [self.dtype_of[v] for v in incoming]))
        for p in schedule.pieces[stage]:
            a, b = p.rows
            for i in schedule.sliced[p.root].read:
                rows = jax.lax.slice_in_dim(vals[("leaf", i)], a, b, axis=0)
                key = ("read", j, p.root, p.index, i)
                (vals[key],) = fetch(self.options, [rows], [self.dtype_of[self.state_invars[i]]])
                if i in self.sliced_leaves:
                    self.pending.setdefault(i, []).append(key)

    def fetch_early(self, j: int) -> None:
        """Trace run `j`'s fetch now if it reads rows of a split leaf (see `_run`)."""
        if j < len(self.runs) and self.schedule.pieces[self.runs[j]]:
            self.fetch(j)
            self.fetched.add(j)

    def run(self, j: int) -> None:
        """Run `j`: its fetch (unless traced early), its stage's equations, its new
        state narrowed and sent to host, its pieces; then what later runs wait for (its
        state on host; for a group whose state is only read, its updates), and the fetch
        of run `j + 1 + lookahead` if that one is early."""
        vals, stage = self.vals, self.runs[j]
        if j not in self.fetched:
            self.fetch(j)
        self.env.run(self.schedule.stages[stage])
        produced = [("out", k) for k in self.outputs_of.get(stage, [])]
        vals.update((key, self.env.read(self.jaxpr.outvars[key[1]])) for key in produced)
        to_host = [key for key in produced if key[1] in self.schedule.host_outputs]
        # (as they go to host: a barrier on anything XLA would not materialise anyway,
        # such as the float32 state that host_dtype narrows, changes its fusions)
        computed = narrowed(self.options, [vals[key] for key in to_host])
        vals.update(zip(to_host, computed, strict=True))
        vals.update(zip(to_host, store(self.options, [vals[key] for key in to_host],
                                             "pinned_host"), strict=True))
        for p in self.schedule.pieces[stage]:
            host, updates = _run_piece(self, j, p, computed)
            to_host += host
            produced += updates
        if computed:
            self.latest[:] = computed
        self.fences.append(to_host if to_host or stage == 0 else produced)
        self.fetch_early(j + 1 + self.options.lookahead)

    def outputs(self) -> list[Any]:
        """The jaxpr's outputs: those the runs made, the host buffers of the split
        leaves, and what no stage produced (inputs or constants returned as they are;
        a literal as an array, as `inner.update` called itself returns it)."""
        outputs = []
        for k, v in enumerate(self.jaxpr.outvars):
            if ("out", k) in self.vals:
                outputs.append(self.vals[("out", k)])
            elif k >= self.n_updates and k - self.n_updates in self.sliced_leaves:
                outputs.append(self.vals[("leaf", k - self.n_updates)])
            elif is_var(v):
                outputs.append(self.env.read(v))
            else:
                outputs.append(jnp.asarray(self.env.read(v), v.aval.dtype))
        return outputs


# The pieces of a split unit (a stacked leaf's rows), run by `_Runner.run`.


def _run_piece(runner: _Runner, j: int, p: _Piece, computed: list[Any]) -> tuple[list[Any], list[Any]]:
    """Run a split unit's equations on its rows; returns the keys of what goes to
    host and of the updates, and appends the new rows of state (on the device) to
    `computed`."""
    local = _piece_values(runner, j, p)
    to_host: list[Any] = []
    updates: list[Any] = []
    for k in runner.schedule.sliced[p.root].outputs:
        value = local[runner.jaxpr.outvars[k]]
        if k in runner.into:
            updates.append(_write_update(runner, k, p, local[runner.into[k][0]]))
        elif k in runner.into_host:
            updates.append(_write_host_update(runner, k, p, value))
        elif k < runner.n_updates:
            updates.append(_keep_update_rows(runner, k, p, value))
        else:
            to_host.append(_write_state_rows(runner, j, k - runner.n_updates, p, value, computed))
    return to_host, updates


def _piece_values(runner: _Runner, j: int, p: _Piece) -> dict[Any, Any]:
    """The values of a split unit's equations on piece `p`'s rows, by variable: its
    rows of state (fetched by run `j`) and of what it reads that is computed
    without the state, and what its equations make of them."""
    unit = runner.schedule.sliced[p.root]
    a, b = p.rows
    local = {runner.state_invars[i]: runner.vals[("read", j, p.root, p.index, i)] for i in unit.read}

    def read(v: Any) -> Any:
        if not is_var(v):
            return v.val
        if v not in local:  # computed without the state: gradients, parameters, scalars
            k = runner.source_of.get(p.root, {}).get(v)
            x = runner.env.read(v) if k is None else runner.vals[("acc", k)]
            local[v] = jax.lax.slice_in_dim(x, a, b, axis=0) if np.ndim(x) else x
        return local[v]

    for eqn in unit.eqns:
        local.update(zip(eqn.outvars, bind(eqn, [read(v) for v in eqn.invars]), strict=True))
    return local


def _write_update(runner: _Runner, k: int, p: _Piece, rows: Any) -> Any:
    """Write piece `p`'s `rows` of update `k` into its gradient's buffer (`into`);
    after the last piece, the update is the buffer with the trailing operations of
    `_tails` applied. Returns the buffer's key."""
    cut, tail = runner.into[k]
    key = ("acc", k)
    # The barrier keeps the write in place, and out of `apply_updates`'s
    # fusion (which would keep every piece's inputs until the last one).
    runner.vals[key] = optimization_barrier(
        jax.lax.dynamic_update_slice_in_dim(runner.vals[key], rows, p.rows[0], axis=0))
    if p.last:
        whole = {cut: runner.vals[key]}
        for eqn in tail:
            args = [whole[v] if is_var(v) and v in whole else runner.env.read(v)
                    for v in eqn.invars]
            whole.update(zip(eqn.outvars, bind(eqn, args), strict=True))
        runner.vals[("out", k)] = whole[runner.jaxpr.outvars[k]]
    return key


def _write_host_update(runner: _Runner, k: int, p: _Piece, rows: Any) -> Any:
    """Send piece `p`'s `rows` of update `k` to host and write them into its
    gradient's host buffer, in place (`into_host`); after the last piece, the update
    is that buffer. Returns the buffer's key."""
    key = ("acc", k)
    (moved,) = move([rows], True, memory_kind_of(runner.vals[key]), "memory_kind")
    runner.vals[key] = jax.lax.dynamic_update_slice_in_dim(runner.vals[key], moved, p.rows[0],
                                                         axis=0)
    if p.last:
        runner.vals[("out", k)] = runner.vals[key]
    return key


def _keep_update_rows(runner: _Runner, k: int, p: _Piece, value: Any) -> Any:
    """Keep piece `p`'s rows of update `k` (an update not written into a gradient's
    buffer); after the last piece, the update is their concatenation. Returns the
    rows' key."""
    rows_key = ("upd", k, p.index)
    runner.vals[rows_key] = value
    runner.updates_of.setdefault(k, []).append(rows_key)
    if p.last:
        runner.vals[("out", k)] = jax.numpy.concatenate(
            [runner.vals[u] for u in runner.updates_of[k]], axis=0)
    return rows_key


def _write_state_rows(runner: _Runner, j: int, i: int, p: _Piece, value: Any, computed: list[Any]) -> Any:
    """Send piece `p`'s new rows of state leaf `i` (run `j`) to host, narrowed, and
    write them into the leaf's host buffer, in place; appends them as computed (on
    the device) to `computed`. Returns the buffer's key."""
    (value,) = narrowed(runner.options, [value])
    computed.append(value)
    (rows,) = store(runner.options, [value], "pinned_host")
    key = ("leaf", i)
    ahead = [r for r in runner.pending.pop(i, []) if r[1] > j]
    if ahead:
        # Pieces of this leaf fetched ahead read its buffer before this write
        # lands in it (in place): they need no copy of the buffer.
        buffer, reads = optimization_barrier(
            (runner.vals[key], [runner.vals[r] for r in ahead]))
        runner.vals[key] = buffer
        runner.vals.update(zip(ahead, reads, strict=True))
    runner.vals[key] = jax.lax.dynamic_update_slice_in_dim(runner.vals[key], rows, p.rows[0], axis=0)
    return key


def _run(traced: TracedUpdate, schedule: _Schedule, options: Options,
         init_dtypes: Sequence[Any]) -> list[Any]:
    """The flat outputs of the update, evaluated stage by stage (see `_Runner`)."""
    runner = _Runner.start(traced, schedule, options, init_dtypes)
    # A run's fetch is traced when its run starts, or, if it reads rows of a split leaf,
    # as soon as its barrier can be (then its reads come before the writes of the runs
    # in between, in place). The program's data flow is the same either way.
    for j in range(options.lookahead + 1):
        runner.fetch_early(j)
    for j in range(len(runner.runs)):
        runner.run(j)
    return runner.outputs()


def _trace_streamable(inner: Any, updates: Any, inner_state: Any, params: Any,
                      extra_args: dict[str, Any],
                      state_dtypes: Optional[Sequence[Any]] = None) -> TracedUpdate:
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
                               [widened_dtype(options, x.dtype, d) for x, d in arrays])
    assert options.group_bytes is not None
    schedule = _schedule(traced, options.group_bytes)  # may raise NotStreamable
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
        plan = eqx_offload.stream.stream_plan(
            optax.adam(1e-3), params, state.inner_state, group_bytes=1 << 19
        )
        assert len(plan.groups) == 2  # mu and nu of "a", then of "b"
        ```
    """
    inner = as_transformation(inner, "stream_plan(inner=...)")
    traced = _trace_streamable(inner, updates, inner_state, params, extra_args)
    return _schedule(traced, group_bytes).plan

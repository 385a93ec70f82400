"""The pieces of a split unit (a stacked leaf's rows), run by `Runner.run`: the unit's
equations on the piece's rows, and where each result goes (the leaf's host buffer, the
gradient's buffer, or rows kept for a concatenation)."""

from typing import Any

import jax
import numpy as np

from .._core.compat import optimization_barrier
from .._core.move import move
from .._core.placement import memory_kind_of
from .evaluation import Evaluation
from .groups import Piece
from .jaxpr import bind, is_var


def run_piece(runner: Evaluation, j: int, p: Piece,
              computed: list[Any]) -> tuple[list[Any], list[Any]]:
    """Run a split unit's equations on its rows; returns the keys of what goes to
    host and of the updates, and appends the new rows of state (on the device) to
    `computed`."""
    local = piece_values(runner, j, p)
    to_host: list[Any] = []
    updates: list[Any] = []
    for k in runner.schedule.sliced[p.root].outputs:
        value = local[runner.jaxpr.outvars[k]]
        if k in runner.into:
            updates.append(write_update(runner, k, p, _fenced_on_cpu(local[runner.into[k][0]])))
        elif k in runner.into_host:
            updates.append(write_host_update(runner, k, p, value))
        elif k < runner.n_updates:
            updates.append(keep_update_rows(runner, k, p, value))
        else:
            to_host.append(write_state_rows(runner, j, k - runner.n_updates, p, value, computed))
    return to_host, updates


def piece_values(runner: Evaluation, j: int, p: Piece) -> dict[Any, Any]:
    """The values of a split unit's equations on piece `p`'s rows, by variable: its
    rows of state (fetched by run `j`) and of what it reads that is computed
    without the state, and what its equations make of them."""
    unit = runner.schedule.sliced[p.root]
    a, b = p.rows
    # On the CPU the piece's rows of state come in, and its new state and its update
    # go out, as buffers of their own (fenced; the update in `run_piece`): XLA:CPU then
    # compiles the piece's arithmetic as it compiles the whole update's. Unfenced, a
    # fusion that reads rows of two buffers at a row offset (a later piece's state and
    # gradient) may be vectorised otherwise, its multiply-adds left uncontracted (JAX
    # 0.12 on AVX-512: Adam's second moment, 1 ulp); the new state may be made a second
    # time inside the update's fusion, contracted otherwise (JAX 0.12.1: Adam's
    # moments, 1 ulp in the update); and the update, fused into its write into the
    # gradient's buffer, may be rounded otherwise (JAX 0.12 at LLVM -O1: Lion, RMSProp).
    # Elsewhere the fences would only hold the values longer (a TPU's temporaries grow).
    local = {runner.state_invars[i]: _fenced_on_cpu(runner.vals[("read", j, p.root, p.index, i)])
             for i in unit.read}

    def read(v: Any) -> Any:
        if not is_var(v):
            return v.val
        if v not in local:  # computed without the state: gradients, parameters, scalars
            k = runner.source_of.get(p.root, {}).get(v)
            x = runner.env.read(v) if k is None else runner.vals[("acc", k)]
            local[v] = jax.lax.slice_in_dim(x, a, b, axis=0) if np.ndim(x) else x
        return local[v]

    state = {runner.jaxpr.outvars[k] for k in unit.outputs if k >= runner.n_updates}
    for eqn in unit.eqns:
        out = bind(eqn, [read(v) for v in eqn.invars])
        local.update((v, _fenced_on_cpu(x) if v in state else x)
                     for v, x in zip(eqn.outvars, out, strict=True))
    return local


def write_update(runner: Evaluation, k: int, p: Piece, rows: Any) -> Any:
    """Write piece `p`'s `rows` of update `k` into its gradient's buffer (`into`);
    after the last piece, the update is the buffer with the trailing operations of
    `rows.tails` applied. Returns the buffer's key."""
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


def write_host_update(runner: Evaluation, k: int, p: Piece, rows: Any) -> Any:
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


def keep_update_rows(runner: Evaluation, k: int, p: Piece, value: Any) -> Any:
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


def write_state_rows(runner: Evaluation, j: int, i: int, p: Piece, value: Any,
                     computed: list[Any]) -> Any:
    """Send piece `p`'s new rows of state leaf `i` (run `j`) to host, narrowed, and
    write them into the leaf's host buffer, in place; appends them as computed (on
    the device) to `computed`. Returns the buffer's key."""
    (value,) = runner.transfers.narrow([value], [runner.dtype_of[runner.state_invars[i]]])
    computed.append(value)
    (rows,) = runner.transfers.store([value])
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


def _fenced_on_cpu(x: Any) -> Any:
    """`x` behind an optimization barrier where the program is lowered for a CPU."""
    return jax.lax.platform_dependent(x, cpu=optimization_barrier, default=_as_is)


def _as_is(x: Any) -> Any:
    return x

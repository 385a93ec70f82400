"""Running a schedule, run by run: each run's fetch (behind its barrier), its stage's
equations, its new state sent to host and its pieces; then the update's outputs. See
`update`'s module docstring for why the barriers are where they are."""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._core.compat import optimization_barrier
from .evaluation import Evaluation
from .jaxpr import is_var
from .pieces import run_piece
from .schedule import Schedule
from .trace import TracedUpdate
from .transfers import Transfers


class Runner(Evaluation):
    """An `Evaluation` run by run (`run`): its fetches, its runs, its outputs."""

    def fetch(self, j: int) -> None:
        """Bring run `j`'s state to the device: after the state of run `j - 1 -
        lookahead` is back on host, and nothing else (traced as soon as that is known,
        so a split leaf's later pieces are read before its earlier ones are written)."""
        schedule, vals, env = self.schedule, self.vals, self.env
        stage = self.runs[j]
        incoming = schedule.group_invars[stage]
        lookahead = self.transfers.lookahead
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
            # instead of 256 MiB (16 x 64 MiB params, Adam;
            # bench/results/h200-2026-11-29/gpu_peak.py).
            fenced, state, _ = optimization_barrier(
                ([vals[k] for k in keys], env.read_all(incoming), after)
            )
            vals.update(zip(keys, fenced, strict=True))
            env.write(incoming, state)
        env.write(incoming, self.transfers.fetch(env.read_all(incoming),
                                                 [self.dtype_of[v] for v in incoming]))
        for p in schedule.pieces[stage]:
            a, b = p.rows
            for i in schedule.sliced[p.root].read:
                rows = jax.lax.slice_in_dim(vals[("leaf", i)], a, b, axis=0)
                key = ("read", j, p.root, p.index, i)
                (vals[key],) = self.transfers.fetch([rows], [self.dtype_of[self.state_invars[i]]])
                if i in self.sliced_leaves:
                    self.pending.setdefault(i, []).append(key)

    def fetch_early(self, j: int) -> None:
        """Trace run `j`'s fetch now if it reads rows of a split leaf (see `run`)."""
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
        computed = self.transfers.narrow(
            [vals[key] for key in to_host],
            [self.dtype_of[self.state_invars[k - self.n_updates]] for _, k in to_host])
        vals.update(zip(to_host, computed, strict=True))
        vals.update(zip(to_host, self.transfers.store([vals[key] for key in to_host]),
                        strict=True))
        for p in self.schedule.pieces[stage]:
            host, updates = run_piece(self, j, p, computed)
            to_host += host
            produced += updates
        if computed:
            self.latest[:] = computed
        self.fences.append(to_host if to_host or stage == 0 else produced)
        self.fetch_early(j + 1 + self.transfers.lookahead)

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


def run(traced: TracedUpdate, schedule: Schedule, transfers: Transfers,
        init_dtypes: Sequence[Any]) -> list[Any]:
    """The flat outputs of the update, evaluated stage by stage (see `Evaluation`)."""
    runner = Runner.start(traced, schedule, transfers, init_dtypes)
    # A run's fetch is traced when its run starts, or, if it reads rows of a split leaf,
    # as soon as its barrier can be (then its reads come before the writes of the runs
    # in between, in place). The program's data flow is the same either way.
    for j in range(transfers.lookahead + 1):
        runner.fetch_early(j)
    for j in range(len(runner.runs)):
        runner.run(j)
    return runner.outputs()

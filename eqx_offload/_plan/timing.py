"""The step time a TPU v5e plan predicts (`Plan.predicted_step_seconds`): the step's
schedule replayed, its device work beside its copies, with constants measured on a v5e
(`docs/results.md`, "The step time a plan predicts", gives each row's prediction
against the chip and the method).

What the chip showed, and the model keeps, a term per cause:

- The device work takes XLA:TPU's own estimate of it (the `estimated_cycles` it writes
  on each instruction, `PlannedKernel`) at `ESTIMATE_SCALE`, from the plain step,
  which moves nothing: the kernels run one after the other, a loop its body's trips.
- Each direction of the link runs at 14 GB/s, and both run at once: with up to 4
  copies each way in flight, both directions together take 1.10x one direction's time;
  with more, the copies queue (1.51x at 8 each way, 1.73x at 16, 1.85x at 32; `DUPLEX`,
  from `../shared/tpu-results/2026-12-06b/duplex.py`).
- The copies move while the kernels run; at a copy's completion the schedule waits for
  it (`replay_seconds`). So a copy XLA scheduled under enough compute costs nothing,
  and one the next kernel needs stalls the device.
- The device writes host outputs that do not reuse a donated input's buffer (new
  host memory each step) at `NEW_HOST_BYTES_PER_S`, over twenty times slower than into
  a donated buffer (`slow_write_seconds`, added). Host temporaries go at the link's
  speed in the schedule's replay (`NEW_HOST_BYTES_PER_S` says why).

A plan without XLA:TPU's estimates (a schedule recorded without them) takes the longer
of its compute floor over `COMPUTE_EFFICIENCY` and its copies replayed alone.

A model, not a measurement: the chip is the judge.
"""

import math
from collections.abc import Sequence
from typing import Any, Optional


ESTIMATE_SCALE = 0.783
"""The time a v5e takes for a step's device work over XLA:TPU's estimate of it (the
`estimated_cycles` of its instructions at `CLOCK_HZ`): the plain 8-layer Llama step
(d=2048, seq 1024, batch 4) took 192.6 ms against 246.0 ms estimated (2026-12-06,
`bench/results/tpu-v5e-2026-12-06g/`)."""

CLOCK_HZ = 1.5e9
"""A v5e's clock: its 197 TFLOP/s of bf16 over 4 matrix units of 128 x 128."""

COMPUTE_EFFICIENCY = 0.446
"""For a plan without XLA:TPU's estimates: the plain 8-layer Llama step (d=2048, seq
1024, batch 4) on a v5e, its plan's compute floor 78.3 ms against the 175.4 ms the chip
took (2026-12-06)."""

NEW_HOST_BYTES_PER_S = 0.625e9
"""The device writing into host memory allocated for the step on a v5e: fitted to the
8-layer step with everything in host memory (2.71 s, of which 1.18 s for the rest of its
copies at 14 GB/s, leaves 1.53 s for its 0.956 GB of host temporaries). Alone, a copy
into a newly made `pinned_host` buffer ran at 0.46-0.47 GB/s (2026-12-06,
`../shared/tpu-results/2026-12-06/README.md`); in the step part of it runs beside the
link's other copies. That fit was made without the schedule's replay; the replay of
the steps measured since with host temporaries (0.13 to 1.11 GB of them) meets the chip
within 4% with the temporaries at the link's speed and overshoots by 9 to 49% with them
at this rate (`docs/results.md`). So the replay counts only unaliased host outputs
here, and a plan without estimates keeps the fit."""

CALIBRATED_CHIPS = frozenset({"TPU v5 lite"})
"""The chips whose steps calibrated the model (a plan for another predicts nothing)."""


DUPLEX = ((4, 1.10), (8, 1.51), (16, 1.73), (32, 1.85), (64, 2.0))
"""Copies in flight each way, and the time both directions then take together over the
time of one (equal bytes each way), on a v5e: measured up to 32 (`duplex.py`,
2026-12-06b: 1 to 4 copies each way 1.10-1.11, 8 1.51-1.52, 16 1.73, 32 1.85); at 64,
one direction after the other (2.0, the limit the measured rows approach)."""


def duplex_slowdown(in_flight: int) -> float:
    """Both directions' time over one direction's, with `in_flight` copies each way:
    `DUPLEX`, linear in log2 of the copies between its rows."""
    n = max(1, in_flight)
    if n <= DUPLEX[0][0]:
        return DUPLEX[0][1]
    for (n0, f0), (n1, f1) in zip(DUPLEX, DUPLEX[1:]):
        if n <= n1:
            return f0 + (f1 - f0) * math.log2(n / n0) / math.log2(n1 / n0)
    return DUPLEX[-1][1]


def replay_seconds(copies: Sequence[Any], bandwidth: float,
                   kernels: Sequence[tuple[int, float]] = ()) -> float:
    """The time of one computation's copies and device work, replayed in schedule
    order: `kernels` are `(position, seconds)` of its device work, run one after the
    other; each direction of the link is a lane of `bandwidth` bytes/s shared by the
    copies moving on it, moving while the kernels run; a copy starts moving at its
    start, and at its completion the schedule waits for it. While both lanes move bytes
    each runs `duplex_slowdown(n)` times slower, `n` the most copies moving on either. A
    copy of unknown position (`start` of -1) is in flight from the computation's start
    to its end."""
    end = max([c.done for c in copies] + [p for p, _ in kernels] + [0]) + 1
    events = sorted([(c.start if c.start >= 0 else 0, 0, k, 0.0) for k, c in enumerate(copies)]
                    + [(c.done if c.start >= 0 else end, 1, k, 0.0) for k, c in enumerate(copies)]
                    + [(p, 2, -1, seconds) for p, seconds in kernels])
    lanes: dict[str, set[int]] = {"to_device": set(), "to_host": set()}  # copies moving
    left = [float(c.nbytes) for c in copies]
    clock = 0.0

    def advance(until: Optional[int] = None, seconds: float = math.inf) -> None:
        """Move the copies until copy `until` is done (all, for `None`), or for
        `seconds` of device work."""
        nonlocal clock
        stop = clock + seconds
        while any(lanes.values()) and (until is None or any(until in q for q in lanes.values())):
            busy = [q for q in lanes.values() if q]
            slowdown = duplex_slowdown(max(map(len, busy))) if len(busy) == 2 else 1.0
            rates = {id(q): bandwidth / slowdown / len(q) for q in busy}
            step = min([left[k] / rates[id(q)] for q in busy for k in q] + [stop - clock])
            clock += step
            for q in busy:
                for k in list(q):
                    left[k] -= step * rates[id(q)]
                    if left[k] <= 1e-6 * max(1.0, copies[k].nbytes):
                        q.discard(k)
            if clock >= stop:
                return
        if math.isfinite(stop):
            clock = stop

    for _, kind, k, seconds in events:
        if kind == 2:
            advance(seconds=seconds)
        elif kind == 1:
            advance(k)
        elif copies[k].nbytes > 0:
            lanes[copies[k].direction].add(k)
    advance()
    return clock


def schedule_seconds(plan: Any) -> float:
    """The step's time from its schedule: each computation's copies and kernels
    replayed together (`replay_seconds`), a kernel taking XLA:TPU's estimate of it at
    `ESTIMATE_SCALE`, a loop its body's time times its trips, a conditional its
    costliest branch's."""
    bandwidth = float(plan.chip.host_link_bandwidth)
    copies: dict[str, list[Any]] = {}
    for c in plan.copies:
        copies.setdefault(c.computation, []).append(c)
    kernels: dict[str, list[Any]] = {}
    for k in plan.kernels:
        kernels.setdefault(k.computation, []).append(k)
    called = {c for k in plan.kernels for c in k.calls}
    seconds: dict[str, float] = {}

    def run(name: str) -> float:
        if name not in seconds:
            seconds[name] = 0.0  # (a loop that reached itself)
            seconds[name] = replay_seconds(copies.get(name, []), bandwidth, [
                (k.position, max(map(run, k.calls)) * k.trips if k.calls
                 else k.cycles / CLOCK_HZ * ESTIMATE_SCALE) for k in kernels.get(name, [])])
        return seconds[name]

    return float(sum(run(name) * max([c.count for c in copies.get(name, [])] + [1])
                     for name in sorted(set(copies) | set(kernels)) if name not in called))


def new_host_bytes(plan: Any, temporaries: bool = True) -> int:
    """The bytes a step writes into host memory allocated for it: its host outputs that
    do not reuse a donated input's buffer, and (with `temporaries`) its host
    temporaries."""
    return int(plan.unaliased_host_output_bytes + (plan.host_temp_bytes if temporaries else 0))


def slow_write_seconds(plan: Any, temporaries: bool = True) -> float:
    """The time the bytes written into new host memory (`new_host_bytes`, at most the
    bytes copied to the host) take beyond the link's: they go at
    `NEW_HOST_BYTES_PER_S`."""
    slow = min(new_host_bytes(plan, temporaries), plan.bytes_moved("to_host"))
    return float(slow * (1 / NEW_HOST_BYTES_PER_S - 1 / float(plan.chip.host_link_bandwidth)))


def link_seconds(plan: Any) -> float:
    """The link's time for the step's copies alone: each computation's copies replayed
    (`replay_seconds`, no kernels) at the chip's `host_link_bandwidth`, times the runs
    of that computation (a loop body's trips), and `slow_write_seconds`."""
    bandwidth = float(plan.chip.host_link_bandwidth)
    by_computation: dict[str, list[Any]] = {}
    for c in plan.copies:
        by_computation.setdefault(c.computation, []).append(c)
    replayed = sum(replay_seconds(cs, bandwidth) * max(c.count for c in cs)
                   for cs in by_computation.values())
    return float(replayed + slow_write_seconds(plan))


def predict_seconds(plan: Any) -> Optional[float]:
    """The step time the model predicts for a plan (seconds), or `None` for a chip the
    model was not calibrated on: its schedule replayed (`schedule_seconds`) with the
    slow writes of its unaliased host outputs (its host temporaries at the link's
    speed: `NEW_HOST_BYTES_PER_S`); for a plan without XLA:TPU's estimates, the longer
    of its compute floor over `COMPUTE_EFFICIENCY` and `link_seconds`."""
    if plan.chip is None or getattr(plan.chip, "name", None) not in CALIBRATED_CHIPS:
        return None
    if plan.kernels:
        return float(schedule_seconds(plan) + slow_write_seconds(plan, temporaries=False))
    compute = plan.compute_floor_seconds / COMPUTE_EFFICIENCY
    return float(max(compute, link_seconds(plan)))

"""The step time a v5e plan predicts (`Plan.predicted_step_seconds`, `_plan/timing.py`):
the model's arithmetic, and its error against the steps measured on a v5e."""

import dataclasses
import json
import pathlib
from typing import Any

import pytest

from eqx_offload._plan import hlo, kernels, timing
from eqx_offload._plan.kernels import PlannedKernel
from eqx_offload.planner import Plan, PlannedCopy, TPU_TARGETS


def _plan(to_device: int, to_host: int, *, host_temp: int = 0, unaliased: int = 0,
          flops: float = 0.0, chip: str = "v5e", serial: bool = True) -> Plan:
    """A plan with these copies (one each way: one after the other, or both in flight at
    once), host bytes and bf16 flops."""
    positions = ((0, 1), (2, 3)) if serial else ((0, 2), (1, 3))
    copies = (PlannedCopy("to_device", to_device, True, 1, "in", start=positions[0][0],
                          done=positions[0][1]),
              PlannedCopy("to_host", to_host, True, 1, "out", start=positions[1][0],
                          done=positions[1][1]))
    return _with_copies(copies, host_temp=host_temp, unaliased=unaliased, flops=flops,
                        chip=chip)


def _with_copies(copies: tuple[PlannedCopy, ...], *, host_temp: int = 0, unaliased: int = 0,
                 flops: float = 0.0, chip: str = "v5e") -> Plan:
    return Plan("chip", 1 << 34, 0, 0, 0, 0, 0, 0, None, copies, {},
                matmul_flops={"bf16": flops}, chip=TPU_TARGETS[chip],
                host_output_bytes=unaliased, host_temp_bytes=host_temp)


def _both_ways(n: int, nbytes: int) -> tuple[PlannedCopy, ...]:
    """`n` copies each way of `nbytes` in all, all started before any completes (as
    `duplex.py`'s `both` program)."""
    return tuple(PlannedCopy(d, nbytes // n, False, 0, f"{d}{k}", start=2 * k + (d == "to_host"),
                             done=4 * n + 2 * k + (d == "to_host"))
                 for k in range(n) for d in ("to_device", "to_host"))


def test_copies_one_after_the_other_take_both_directions() -> None:
    assert timing.predict_seconds(_plan(14 * 10**9, 7 * 10**9)) == pytest.approx(1.5)


def test_copies_in_flight_together_take_both_directions_at_once() -> None:
    """One copy each way in flight together: 1.10x the larger while both run, then the
    rest of the larger alone."""
    planned = _plan(14 * 10**9, 7 * 10**9, serial=False)
    assert timing.predict_seconds(planned) == pytest.approx(0.5 * 1.10 + 0.5)


# `../shared/tpu-results/2026-12-06b/duplex.py` on a v5e: GiB each way, copies each way,
# and the ms of host->device alone, device->host alone, both in one program.
DUPLEX_ROWS = [(0.5, 1, 38.7, 39.0, 43.1), (1, 1, 76.7, 77.0, 85.1), (1, 2, 77.0, 75.6, 84.9),
               (1, 4, 76.9, 74.8, 84.9), (1, 8, 76.9, 74.4, 116.3), (1, 16, 77.1, 74.4, 133.3),
               (2, 2, 152.5, 150.1, 168.8), (2, 8, 152.4, 147.8, 231.2),
               (4, 32, 304.3, 293.1, 562.2)]


@pytest.mark.parametrize("row", DUPLEX_ROWS, ids=lambda r: f"{r[0]}GiB-{r[1]}")
def test_the_link_model_is_within_10_percent_of_the_duplex_probe(row: tuple) -> None:
    gib, n, h2d, d2h, both = row
    nbytes = int(gib * (1 << 30))
    one_way = timing.link_seconds(_with_copies(_both_ways(n, nbytes)[::2]))
    together = timing.link_seconds(_with_copies(_both_ways(n, nbytes)))
    assert abs(one_way / (h2d / 1e3) - 1) <= 0.10
    assert abs(together / (both / 1e3) - 1) <= 0.10


@pytest.mark.parametrize("n", [1, 4, 8, 32, 64, 128])
def test_the_duplex_slowdown_grows_from_duplex_to_one_direction_at_a_time(n: int) -> None:
    f = timing.duplex_slowdown(n)
    assert 1.10 <= f <= 2.0
    assert f <= timing.duplex_slowdown(2 * n)
    assert (f == 1.10) == (n <= 4) and (f == 2.0) == (n >= 64)


def test_writes_into_new_host_memory_are_slow() -> None:
    """Host temporaries and unaliased host outputs are written at the slow rate."""
    fast = timing.predict_seconds(_plan(0, 14 * 10**9))
    temps = timing.predict_seconds(_plan(0, 14 * 10**9, host_temp=10**9))
    unaliased = timing.predict_seconds(_plan(0, 14 * 10**9, unaliased=10**9))
    slow = 10**9 / timing.NEW_HOST_BYTES_PER_S - 10**9 / 14e9
    assert temps == unaliased == pytest.approx(fast + slow)


def test_compute_bound_steps_take_their_compute_and_other_chips_predict_nothing() -> None:
    compute = 197e12 * 0.5  # half a second at the v5e's peak
    planned = _plan(10**9, 10**9, flops=compute)
    assert timing.predict_seconds(planned) == pytest.approx(0.5 / timing.COMPUTE_EFFICIENCY)
    assert timing.predict_seconds(dataclasses.replace(planned, chip=TPU_TARGETS["v5p"])) is None
    assert timing.predict_seconds(dataclasses.replace(planned, chip=None)) is None


def test_the_recorded_schedule_of_the_state_step_is_within_15_percent_of_the_chip() -> None:
    """The 8-layer `offloaded(adamw)` Llama step's copies as XLA:TPU schedules them
    (recorded: direction, bytes, start, completion): 42 each way, at most 5 in flight;
    replayed, 0.482 s of link against 0.564 s on the chip (its compute, 0.175 s, runs
    beside it)."""
    recorded = json.loads((pathlib.Path(__file__).parent / "v5e_llama_state8_copies.json")
                          .read_text())
    copies = tuple(PlannedCopy(d, n, True, 1, f"c{k}", computation="main", start=a, done=b)
                   for k, (d, n, a, b) in enumerate(recorded["copies"]))
    predicted = timing.predict_seconds(_with_copies(copies, flops=0.0782905 * 197e12))
    assert predicted is not None and abs(predicted / 0.5641 - 1) <= 0.15


# The v5e plans of issue 56's rows (`python bench/results/tpu-v5e-2026-12-06/plan_vs_chip.py --llama ROW`, JAX
# 0.10.2: bytes to the device and to the host, host temporaries, compute floor in
# seconds) and the step the chip took (2026-12-06, docs/gpu-plan.md "The step time a
# plan predicts"). `plain-8` calibrated `COMPUTE_EFFICIENCY`, `activations-8`
# `NEW_HOST_BYTES_PER_S`; the others are predictions. Their schedules were not recorded:
# planned here as one copy each way, one direction after the other (those steps took
# both directions' bytes one after the other within 10%).
ROWS = {
    "plain-8": (0, 0, 0, 0.0782905, 0.1754),
    "state-8": (4_337_188_864, 4_337_188_864, 0, 0.0782905, 0.5641),
    "state-24": (10_914_381_824, 10_914_381_824, 0, 0.2185201, 1.62),
    "activations-8": (9_209_143_296, 8_284_299_264, 956_301_312, 0.0821276, 2.71),
    "activations-bf16state-20": (13_556_822_016, 11_398_852_608, 2_390_753_280, 0.1930555,
                                 5.71),
    "activations-20": (20_509_384_704, 18_351_415_296, 2_390_753_280, 0.1930555, 6.56),
}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_the_model_is_within_15_percent_of_the_chip(row: str) -> None:
    to_device, to_host, temp, floor, measured = ROWS[row]
    planned = _plan(to_device, to_host, host_temp=temp, flops=floor * 197e12)
    predicted = timing.predict_seconds(planned)
    assert predicted is not None and abs(predicted / measured - 1) <= 0.15


def test_copies_move_while_the_kernels_run_and_the_schedule_waits_at_their_completion(
        ) -> None:
    """A 1.4 GB copy (0.1 s) started before a kernel of 0.3 s and waited for after it
    costs nothing; waited for in the middle of it, the kernel's rest follows the copy."""
    copy = PlannedCopy("to_device", 14 * 10**8, True, 1, "in", start=1, done=3)
    hidden = timing.replay_seconds([copy], 14e9, [(2, 0.3)])
    assert hidden == pytest.approx(0.3)
    waited = timing.replay_seconds([copy], 14e9, [(2, 0.05), (4, 0.25)])
    assert waited == pytest.approx(0.1 + 0.25)


_HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %f = f32[8] fusion(%x), kind=kLoop, calls=%fused, backend_config={"estimated_cycles":"300"}
  %cs = (f32[8]{0:S(5)}, f32[8], u32[]) copy-start(%f)
  %cd = f32[8]{0:S(5)} copy-done(%cs)
  ROOT %t = (s32[], f32[8]) tuple(%i, %f)
}

%yes (a: f32[8]) -> f32[8] {
  ROOT %g = f32[8] fusion(%a), kind=kLoop, calls=%fused, backend_config={"estimated_cycles":"900"}
}

%no (a: f32[8]) -> f32[8] {
  ROOT %h = f32[8] fusion(%a), kind=kLoop, calls=%fused, backend_config={"estimated_cycles":"60"}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8] parameter(0)
  %k = f32[8] fusion(%a), kind=kLoop, calls=%fused, backend_config={"estimated_cycles":"1500"}
  %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %c = f32[8] conditional(%b, %k, %k), branch_computations={%yes, %no}
}
"""


def test_the_kernels_are_xla_tpu_s_estimates_with_loops_and_conditionals() -> None:
    found = kernels.scheduled_kernels(_HLO)
    assert found == (PlannedKernel("body", 2, 300),
                     PlannedKernel("yes", 1, 900), PlannedKernel("no", 1, 60),
                     PlannedKernel("main", 2, 1500), PlannedKernel("main", 3, 0, ("body",), 4),
                     PlannedKernel("main", 4, 0, ("yes", "no")))
    assert kernels.scheduled_kernels(_HLO.replace("estimated_cycles", "flops")) == ()
    # The copy in the loop's body is at its positions (after the body's one kernel).
    (copy,) = hlo.scheduled_copies(_HLO)
    assert (copy.computation, copy.start, copy.done, copy.count) == ("body", 3, 4, 4)
    cycle = timing.ESTIMATE_SCALE / timing.CLOCK_HZ
    planned = dataclasses.replace(_with_copies((copy,)), kernels=found)
    link = 4 * 32 / 14e9  # (the loop's copy, after its kernel)
    assert timing.predict_seconds(planned) == pytest.approx((1500 + 4 * 300 + 900) * cycle
                                                            + link)


# The v5e schedules of the chip's rows (`v5e_schedules.py`: each row planned for a v5e
# without one, JAX 0.10.2, and the step the chip took; `docs/results.md`, "The step
# time a plan predicts").
SCHEDULES = json.loads((pathlib.Path(__file__).parent / "v5e_schedules.json").read_text())


def _recorded(row: dict[str, Any]) -> Plan:
    copies = tuple(PlannedCopy(d, n, True, 1, f"copy{k}", count, computation=str(c),
                               start=a, done=b)
                   for k, (d, n, count, c, a, b) in enumerate(row["copies"]))
    found = tuple(PlannedKernel(str(c), position, cycles, tuple(map(str, calls)), trips)
                  for c, position, cycles, calls, trips in row["kernels"])
    planned = _with_copies(copies, host_temp=row["host_temp_bytes"],
                           unaliased=row["unaliased_host_output_bytes"],
                           flops=row["compute_floor_seconds"] * 197e12)
    return dataclasses.replace(planned, kernels=found)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_schedule_model_is_within_10_percent_of_the_chip(name: str) -> None:
    row = SCHEDULES[name]
    predicted = timing.predict_seconds(_recorded(row))
    assert predicted == pytest.approx(row["predicted_seconds"], rel=1e-9)
    assert abs(predicted / row["measured_seconds"] - 1) <= 0.10


def test_the_replay_writes_unaliased_host_outputs_slowly_and_temporaries_at_link_speed(
        ) -> None:
    """With XLA:TPU's kernels, only the host outputs that reuse no donated buffer go at
    `NEW_HOST_BYTES_PER_S`."""
    work = (PlannedKernel("main", 0, 15 * 10**8),)  # a second at 1.5 GHz, scaled
    base = dataclasses.replace(_plan(0, 14 * 10**9), kernels=work)
    fast = timing.predict_seconds(base)
    temps = timing.predict_seconds(dataclasses.replace(base, host_temp_bytes=10**9))
    unaliased = timing.predict_seconds(dataclasses.replace(base, host_output_bytes=10**9))
    assert fast is not None and fast == temps == pytest.approx(timing.ESTIMATE_SCALE + 1.0)
    assert unaliased == pytest.approx(fast + 10**9 / timing.NEW_HOST_BYTES_PER_S - 10**9 / 14e9)

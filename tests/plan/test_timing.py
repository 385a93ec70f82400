"""The step time a v5e plan predicts (`Plan.predicted_step_seconds`, `_plan/timing.py`):
the model's arithmetic, and its error against the steps measured on a v5e."""

import dataclasses

import pytest

from eqx_offload._plan import timing
from eqx_offload.planner import Plan, PlannedCopy, TPU_TARGETS


def _plan(to_device: int, to_host: int, *, host_temp: int = 0, unaliased: int = 0,
          flops: float = 0.0, chip: str = "v5e") -> Plan:
    """A plan with these copies (one each way), host bytes and bf16 flops."""
    copies = (PlannedCopy("to_device", to_device, True, 1, "in"),
              PlannedCopy("to_host", to_host, True, 1, "out"))
    return Plan("chip", 1 << 34, 0, 0, 0, 0, 0, 0, None, copies, {},
                matmul_flops={"bf16": flops}, chip=TPU_TARGETS[chip],
                host_output_bytes=unaliased, host_temp_bytes=host_temp)


def test_copies_take_the_link_one_direction_at_a_time() -> None:
    planned = _plan(14 * 10**9, 7 * 10**9)
    assert timing.predict_seconds(planned) == pytest.approx(1.5)


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


# The v5e plans of issue 56's rows (`python bench/tpu/plan_vs_chip.py --llama ROW`, JAX
# 0.10.2: bytes to the device and to the host, host temporaries, compute floor in
# seconds) and the step the chip took (2026-12-06, docs/gpu-plan.md "The step time a
# plan predicts"). `plain-8` calibrated `COMPUTE_EFFICIENCY`, `activations-8`
# `NEW_HOST_BYTES_PER_S`; the others are predictions.
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

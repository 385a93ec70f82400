"""The step time a TPU v5e plan predicts (`Plan.predicted_step_seconds`): a model of the
step from what the plan counts, with constants measured on a v5e and calibrated against
its training steps (issue 56's rows; `docs/gpu-plan.md` gives each row's prediction
against the chip and the method).

What the chip showed, and the model keeps:

- The compute runs at a fixed share of the plan's compute floor (`COMPUTE_EFFICIENCY`,
  from the plain step, which moves nothing).
- Copies between host and device take the link's time *one direction at a time*: the
  offloaded steps took (bytes to the device + bytes to the host) / 14 GB/s within 10%,
  not the larger direction's bytes / 14 GB/s that a full-duplex link would give.
- The device writes into host memory allocated for the step (host temporaries, and
  host outputs that do not reuse a donated input's buffer) at `NEW_HOST_BYTES_PER_S`,
  over twenty times slower than into a donated buffer.
- The copies run under the compute (XLA schedules them there): the step takes the
  longer of the two.

A model, not a measurement: the chip is the judge (`bench/tpu/plan_vs_chip.py --llama`).
"""

from typing import Any, Optional


COMPUTE_EFFICIENCY = 0.446
"""The plain 8-layer Llama step (d=2048, seq 1024, batch 4) on a v5e: its plan's compute
floor 78.3 ms against the 175.4 ms the chip took (2026-12-06)."""

NEW_HOST_BYTES_PER_S = 0.625e9
"""The device writing into host memory allocated for the step on a v5e: fitted to the
8-layer step with everything in host memory (2.71 s, of which 1.18 s for the rest of its
copies at 14 GB/s, leaves 1.53 s for its 0.956 GB of host temporaries). Alone, a copy
into a newly made `pinned_host` buffer ran at 0.46-0.47 GB/s (2026-12-06,
`../shared/tpu-results/2026-12-06/README.md`); in the step part of it runs beside the
link's other copies."""

CALIBRATED_CHIPS = frozenset({"TPU v5 lite"})
"""The chips whose steps calibrated the model (a plan for another predicts nothing)."""


def new_host_bytes(plan: Any) -> int:
    """The bytes a step writes into host memory allocated for it: its host temporaries
    and its host outputs that do not reuse a donated input's buffer."""
    return int(plan.host_temp_bytes + plan.unaliased_host_output_bytes)


def link_seconds(plan: Any) -> float:
    """The link's time for the step's copies, one direction at a time: every byte at
    the chip's `host_link_bandwidth`, but those written into new host memory at
    `NEW_HOST_BYTES_PER_S`."""
    moved = plan.bytes_moved("to_device") + plan.bytes_moved("to_host")
    slow = min(new_host_bytes(plan), plan.bytes_moved("to_host"))
    bandwidth = float(plan.chip.host_link_bandwidth)
    return float((moved - slow) / bandwidth + slow / NEW_HOST_BYTES_PER_S)


def predict_seconds(plan: Any) -> Optional[float]:
    """The step time the model predicts for a plan (seconds), or `None` for a chip the
    model was not calibrated on."""
    if plan.chip is None or getattr(plan.chip, "name", None) not in CALIBRATED_CHIPS:
        return None
    compute = plan.compute_floor_seconds / COMPUTE_EFFICIENCY
    return float(max(compute, link_seconds(plan)))

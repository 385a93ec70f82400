"""The device work of a step as XLA:TPU schedules it for a v5e (without one): its
estimated kernels and loops, which `Plan.predicted_step_seconds` replays beside the
copies."""

import jax.numpy as jnp
import pytest
from helpers import host_layer_stack, tpu_plan_marks

from eqx_offload._plan import timing
from eqx_offload.planner import plan, TPU_TARGETS


pytestmark = [pytest.mark.both, *tpu_plan_marks()]  # (libtpu pins its JAX: both environments)


def test_a_scan_over_host_layers_plans_its_loop_and_its_kernels() -> None:
    """Six stacked layers in host memory, run by `scan_layers`: the plan's kernels hold
    the loop (6 trips) around the layer's fetch and matrix product, each with XLA:TPU's
    estimate, and the prediction replays them with the fetch."""
    n, d = 6, 1024
    layers, forward = host_layer_stack(n, d)

    planned = plan(forward, layers, jnp.ones((256, d)), target="v5e")
    (fetch,) = planned.copies_to("to_device")
    (loop,) = [k for k in planned.kernels if k.calls]
    assert loop.trips == n and loop.calls == (fetch.computation,)
    body = [k for k in planned.kernels if k.computation == fetch.computation]
    assert body and all(k.cycles > 0 for k in body)
    fetched = fetch.nbytes / TPU_TARGETS["v5e"].host_link_bandwidth
    computed = sum(k.cycles for k in body) / timing.CLOCK_HZ * timing.ESTIMATE_SCALE
    predicted = planned.predicted_step_seconds
    assert predicted is not None and predicted == pytest.approx(timing.schedule_seconds(planned))
    assert n * max(fetched, computed) <= predicted

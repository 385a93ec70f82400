"""The update inside the backward pass on a TPU v5e, planned without one: the `state`
step (AdamW state in host memory) of a Llama-style decoder (bench/harness.py) compiles for
a v5e with `eqx_offload.update_in_backward`, moves the normal step's bytes each way, and
at width 512 (4 layers) its device peak is within a few layers' state of the normal
step's. (At small widths XLA:TPU plans the pipeline's buffers above the normal step,
whose whole gradient is small there; at 542M below it.)"""

import pathlib
import sys
from typing import Any

import pytest
from helpers import TPU_ENV
from isolated import call_isolated

import eqx_offload


BENCH = str(pathlib.Path(__file__).resolve().parents[2] / "bench")
PACKAGE = str(pathlib.Path(eqx_offload.__file__).resolve().parents[1])
# Small enough to compile in a minute (the layers' gradient: 4 layers of 3.4M fp32
# parameters, 54 MB).
WIDTH, LAYERS, SEQ, BATCH = 512, 4, 128, 2


def abstract_step(mode: str, width: int, layers: int, seq: int, batch: int) -> Any:
    """(In a child.) The donated step of `mode` (`bench/harness.py`) of the decoder at
    this size, and its abstract arguments."""
    sys.path.insert(0, BENCH)
    import harness
    import jax
    import jax.numpy as jnp

    start, grad_step = harness.trainer(harness.llama_shape(width, layers, seq, batch), mode)
    model, state = eqx_offload.checkpoint.filter_eval_shape(start, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=(
        jax.sharding.make_single_device_sharding(jax.devices()[0])))
    return harness.step_of(grad_step), (model, state, tokens)


def plan_both(width: int, layers: int, seq: int, batch: int) -> dict[str, Any]:
    """(In a child, with `TPU_ENV`.) The v5e plan of the normal and the fused step:
    `{name: [device peak, host bytes, stored state bytes, bytes moved to the device and
    to the host, host temporaries, unaliased host outputs, host arguments]}`."""
    import jax

    found = {}
    for name, mode in (("normal", "state"), ("in_backward", "state-backward")):
        step, args = abstract_step(mode, width, layers, seq, batch)
        plan = eqx_offload.plan(step, *args, target="v5e")
        stored = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args[1])
                     if x.sharding.memory_kind == "pinned_host")
        found[name] = [plan.device_peak_bytes, plan.host_total_bytes, stored,
                       plan.bytes_moved("to_device"), plan.bytes_moved("to_host"),
                       plan.host_temp_bytes, plan.unaliased_host_output_bytes,
                       plan.host_argument_bytes]
    return found


@pytest.mark.both  # (libtpu pins its JAX: the newest's plan too; the mode matrix: oldest)
def test_the_fused_step_plans_level_with_the_normal_step(tpu: Any) -> None:
    found = call_isolated(plan_both, WIDTH, LAYERS, SEQ, BATCH,
                          env={**TPU_ENV, "PYTHONPATH": PACKAGE})
    (normal_peak, normal_host, normal_stored, *normal_moved) = found["normal"]
    (fused_peak, fused_host, fused_stored, *fused_moved) = found["in_backward"]
    ffn = (8 * WIDTH // 3 + 255) // 256 * 256
    gradient = LAYERS * (4 * WIDTH * WIDTH + 3 * WIDTH * ffn + 2 * WIDTH) * 4
    layer_state = 2 * gradient // LAYERS  # (AdamW's two moments of one layer)
    # (at this width XLA:TPU plans the backward pass's loops, one for each of the top
    # two layers and one for the rest, with two copies in flight each way, about 4.5
    # layers' state above the normal step; at 542M, 0.4 GB below it)
    assert fused_peak <= normal_peak + 5 * layer_state, (fused_peak, normal_peak, layer_state)
    # The same state in host memory (the two halves hold the same leaves, and each has a
    # step count), and every host output of the normal step aliases its input.
    assert fused_stored == normal_stored
    assert normal_host == normal_stored
    # Each layer's state crosses once each way, as in the normal step, and no new host
    # memory is written: one layer's update leaves its state on the device, the
    # backward scan writes it into the stacked host arrays. (A layer more would be
    # `layer_state` more bytes, over the slack: XLA:TPU's tile padding.)
    to_device, to_host, temp, unaliased, arguments = fused_moved
    assert to_device <= normal_moved[0] + layer_state // 4, (to_device, normal_moved)
    assert to_host <= normal_moved[1] + layer_state // 4, (to_host, normal_moved)
    assert temp == 0
    # The fp32 state's mode of `test_every_mode_with_host_state_compiles_and_aliases`:
    # every host output reuses its donated input's buffer, and the host arguments are
    # what is stored (up to XLA:TPU's tile padding).
    assert unaliased == 0
    assert fused_stored <= arguments <= fused_stored + fused_stored // 100, (
        arguments, fused_stored)


def plan_modes(modes: list[str], width: int, layers: int, seq: int,
               batch: int) -> dict[str, Any]:
    """(In a child, with `TPU_ENV`.) For each mode of `bench/harness.py`: the v5e plan's
    unaliased host output bytes and host argument bytes of its donated step, and the
    bytes it stores in host memory; or the error."""
    import jax

    found: dict[str, Any] = {}
    for mode in modes:
        step, (model, state, tokens) = abstract_step(mode, width, layers, seq, batch)
        try:
            plan = eqx_offload.plan(step, model, state, tokens, target="v5e")
        except eqx_offload.errors.PlanError as e:
            found[mode] = str(e)[:300]
            continue
        stored = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((model, state))
                     if x.sharding.memory_kind == "pinned_host")
        found[mode] = [plan.unaliased_host_output_bytes, plan.host_argument_bytes, stored]
    return found


def test_every_mode_with_host_state_compiles_and_aliases(tpu: Any) -> None:
    """The update inside the backward pass with the state (and weights) in host memory,
    in fp32, bf16 and 8 bits, compiles for a v5e (a bf16 moment of a stacked norm scale
    is updated on the device whole: XLA:TPU cannot slice one row of it in host memory;
    8-bit codes cross the backward pass as float32 bits), and every host output reuses
    its donated input's buffer. (The fp32 state's, `state-backward`, at width 512: in
    `test_the_fused_step_plans_level_with_the_normal_step`, which compiles it.)"""
    _assert_compiled_and_aliased(["state-bf16state-backward", "state-int8state-backward",
                                  *[f"+activations{state}-backward"
                                    for state in ("", "-bf16state", "-int8state")]])


def _assert_compiled_and_aliased(modes: list[str]) -> None:
    """Each of `modes` plans for a v5e (a child, with `TPU_ENV`), no host output without
    its donated input's buffer, and its host arguments what it stores."""
    found = call_isolated(plan_modes, modes, 256, 2, 128, 2,
                          env={**TPU_ENV, "PYTHONPATH": PACKAGE})
    for mode in modes:
        assert isinstance(found[mode], list), (mode, found[mode])
        unaliased, arguments, stored = found[mode]
        assert unaliased == 0, mode
        # (the chip's tile padding: XLA:TPU tiles the two minor axes, 8 x 128 words for
        # 32-bit types; 8-bit state stores a stacked vector as (layers, 2, width / 4),
        # padded to 8 rows: up to 4x for these small leaves, 2.8% of the whole here)
        slack = 20 if "int8" in mode else 100
        assert stored <= arguments <= stored + stored // slack, (mode, arguments, stored)


def plan_start_up(mode: str, width: int, layers: int) -> Any:
    """(In a child, with `TPU_ENV`.) The v5e plan of the start-up of MODE of
    `bench/harness.py` (`filter_make`'s route): whether it fits and the host bytes it
    stores, or the error."""
    sys.path.insert(0, BENCH)
    import harness
    import jax

    start, _ = harness.trainer(harness.llama_shape(width, layers, 128, 2), mode)
    try:
        planned = eqx_offload.planner.plan_startup(start, jax.random.key(0), target="v5e")
    except eqx_offload.errors.OffloadError as e:
        return f"{type(e).__name__}: {str(e)[:300]}"
    return [planned.fits, planned.host_array_bytes]


def test_8_bit_state_starts_up_at_the_benchmark_s_vocabulary(tpu: Any) -> None:
    """The start-up of 8-bit state with the update inside the backward pass at the
    benchmark's vocabulary (32000) and 8 layers of width 512 (the stack's rows, 8 x 512
    values, are quantised where one layer's 512 are not) plans for a v5e; `init` once
    refused it at the embedding's state."""
    found = call_isolated(plan_start_up, "+activations-int8state-backward", 512, 8,
                          env={**TPU_ENV, "PYTHONPATH": PACKAGE})
    assert isinstance(found, list), found
    fits, host_bytes = found
    assert fits and host_bytes > 0


def test_the_stored_once_modes_compile_and_alias(tpu: Any) -> None:
    """Each parameter stored once (docs/capacity.md): the chip's `-once` modes (fp32
    weights of the blocks in host memory as their own master, cast to bf16 on the device
    as each layer is fetched) compile for a v5e, every host output reuses its donated
    input's buffer, and the host arguments are what is stored."""
    _assert_compiled_and_aliased(
        [f"+activations-once{state}-backward" for state in ("", "-bf16state", "-int8state")])

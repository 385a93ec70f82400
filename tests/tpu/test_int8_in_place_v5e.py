"""8-bit state inside the backward pass, written in place, on a TPU v5e planned without
one: at the benchmark's real shape (bench/llama.py's decoder, vocabulary 32000, width
2048, 8 layers; `bench/harness.py`'s fp32 master with 8-bit moments,
everything in host memory, `update_in_backward`), the step writes each layer's new
packed state into the donated host arrays it read. The host holds what is stored, the
layer inputs kept for the backward pass and at most one layer's packed state more: no
float32 view of a stack converted in host memory, no relayout of a stack through it."""

import pathlib
import sys
from typing import Any

from helpers import TPU_ENV
from isolated import result_of, run_isolated

import eqx_offload


BENCH = str(pathlib.Path(__file__).resolve().parents[2] / "bench")
PACKAGE = str(pathlib.Path(eqx_offload.__file__).resolve().parents[1])
MODE = "+activations-once-int8state-backward"
# The real width, vocabulary and depth; a short sequence (the state does not depend on it).
WIDTH, LAYERS, SEQ, BATCH = 2048, 8, 256, 1


def plan_host_bytes(mode: str, width: int, layers: int, seq: int, batch: int) -> dict[str, int]:
    """(In a child, with `TPU_ENV`.) The v5e plan of MODE's donated step: its host
    temporaries, unaliased host outputs, host arguments; the bytes it stores in host
    memory, and one layer's share of its stacked packed (`uint32`) state."""
    sys.path.insert(0, BENCH)
    import harness
    import jax
    import jax.numpy as jnp

    start, grad_step = harness.trainer(harness.llama_shape(width, layers, seq, batch), mode)
    model, state = eqx_offload.checkpoint.filter_eval_shape(start, jax.random.key(0))
    step = eqx_offload.filter_jit(donate=("model", "state"))(
        lambda model, state, tokens: grad_step(model, state, tokens, None))
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=(
        jax.sharding.make_single_device_sharding(jax.devices()[0])))
    plan = eqx_offload.plan(step, model, state, tokens, target="v5e")
    host = [x for x in jax.tree.leaves((model, state))
            if x.sharding.memory_kind == "pinned_host"]
    packed = sum(x.size * x.dtype.itemsize for x in host
                 if x.dtype == jnp.uint32 and x.ndim == 3 and x.shape[0] == layers)
    rest = sum(x.size * x.dtype.itemsize for x in host if x.dtype == jnp.uint32 and x.ndim == 2)
    return {"temp": plan.host_temp_bytes, "unaliased": plan.unaliased_host_output_bytes,
            "arguments": plan.host_argument_bytes,
            "stored": sum(x.size * x.dtype.itemsize for x in host),
            "layer_packed": packed // layers, "rest_packed": rest}


def test_8_bit_state_is_written_into_its_donated_host_arrays(tpu: Any) -> None:
    # (the real width compiles in about 3 CPU minutes)
    found = result_of(run_isolated(plan_host_bytes, MODE, WIDTH, LAYERS, SEQ, BATCH,
                                   timeout=1800, env={**TPU_ENV, "PYTHONPATH": PACKAGE}))
    # (8 layers of 51M parameters: a layer's two moments packed are 104 MB; the
    # embedding's and the head's, updated after the backward pass, 266 MB)
    assert found["layer_packed"] > 64 * 2**20, found
    assert found["unaliased"] == 0, found
    assert found["stored"] <= found["arguments"] <= found["stored"] + found["stored"] // 100
    # Each layer's input, kept in host memory, and what the update of the embedding and
    # the head may hold: far below one copy of the layers' state (835 MB; a float32 view
    # of it converted in host memory, or its relayout, held 1.83 GB).
    inputs = LAYERS * BATCH * SEQ * WIDTH * 4
    assert found["temp"] <= inputs + found["rest_packed"] < LAYERS * found["layer_packed"], found

"""XLA:TPU's plan of one mode of `bench/harness.py` for a v5e, compiled without a chip:
prints the plan's figures as one JSON line and writes the scheduled HLO for
`loop_copies.py`. A plan, not a measurement.

    JAX_PLATFORMS=cpu TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_WORKER_HOSTNAMES=localhost \
        TPU_SKIP_MDS_QUERY=1 PYTHONPATH=. python \
        bench/results/tpu-v5e-2026-12-06e/plan_backward.py state-backward out.hlo [WIDTH LAYERS SEQ BATCH]
"""
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

import eqx_offload
import eqx_offload._plan.plan as planning

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import harness  # (bench/)

mode, out = sys.argv[1], sys.argv[2]
width, layers, seq, batch = (int(a) for a in (sys.argv[3:7] or (2048, 8, 1024, 4)))
texts = []
read_plan = planning._read_plan


def keep_text(executable, *args, **kwargs):
    texts.append(executable.text)
    return read_plan(executable, *args, **kwargs)


planning._read_plan = keep_text
began = time.perf_counter()
start, grad_step = harness.trainer(harness.llama_shape(width, layers, seq, batch), mode)
model, state = eqx_offload.checkpoint.filter_eval_shape(start, jax.random.key(0))
tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=(
    jax.sharding.make_single_device_sharding(jax.devices()[0])))
plan = eqx_offload.plan(harness.step_of(grad_step), model, state, tokens, target="v5e")
pathlib.Path(out).write_text(texts[-1])
print(json.dumps({
    "mode": mode, "width": width, "layers": layers, "jax": jax.__version__,
    "seconds": round(time.perf_counter() - began, 1),
    "device_peak_bytes": plan.device_peak_bytes, "temp_bytes": plan.temp_bytes,
    "host_temp_bytes": plan.host_temp_bytes, "to_device": plan.bytes_moved("to_device"),
    "to_host": plan.bytes_moved("to_host"),
    "predicted_ms": round(1e3 * (plan.predicted_step_seconds or 0.0), 1)}))

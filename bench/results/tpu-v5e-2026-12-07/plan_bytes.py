"""A row's step planned for a TPU v5e without one (libtpu; JAX 0.10.2 here): the device
peak, the bytes each way over the host link, the host temporaries and the time model's
step, as one JSON line. Made the 2026-12-07 floors and peaks of docs/results.md and
docs/backward.md:

    JAX_PLATFORMS=cpu python bench/results/tpu-v5e-2026-12-07/plan_bytes.py MODE WIDTH LAYERS SEQ BATCH
"""

import json
import os
import sys

os.environ.update({"TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_WORKER_HOSTNAMES": "localhost",
                   "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})

import jax  # (after the environment libtpu reads)
import jax.numpy as jnp

import eqx_offload

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import harness  # (bench/)


def main(mode: str, width: int, layers: int, seq: int, batch: int) -> dict[str, object]:
    on = jax.sharding.NamedSharding(jax.sharding.Mesh([jax.devices()[0]], ("_",)),
                                    jax.sharding.PartitionSpec())
    start, grad_step = harness.trainer(harness.llama_shape(width, layers, seq, batch), mode)
    key = jax.eval_shape(lambda: jax.random.key(0))
    model, state = eqx_offload.checkpoint.filter_eval_shape(
        start, jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=on))
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=on)
    plan = eqx_offload.plan(harness.step_of(grad_step), model, state, tokens, target="v5e")
    return {"mode": mode, "layers": layers, "peak_GB": plan.device_peak_bytes / 1e9,
            "to_device_GB": plan.bytes_moved("to_device") / 1e9,
            "to_host_GB": plan.bytes_moved("to_host") / 1e9,
            "host_temp_GB": plan.host_temp_bytes / 1e9,
            "predicted_s": plan.predicted_step_seconds}


if __name__ == "__main__":
    mode, *numbers = sys.argv[1:]
    print(json.dumps(main(mode, *map(int, numbers))))

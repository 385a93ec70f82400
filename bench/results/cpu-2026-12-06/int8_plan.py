"""What 8-bit optimizer state saves on a TPU v5e, planned without one: the bytes the
step moves over the host link and the host bytes, for the project's Llama (d=2048,
seq 1024, batch 4; 8 layers: 542M parameters), with AdamW's state in fp32, bf16 or 8-bit
(`offloaded(..., host_dtype=...)`).

Two ways to train: `state` (fp32 weights on the device, the state in host memory) and
`+params` (bf16 blocks' weights in host memory, fetched a layer at a time, fp32 master
weights and the state in host memory: `master_weights` over `offloaded`). Every number
is XLA:TPU's plan (`eqx_offload.plan(..., target="v5e")`), not a measurement:

    JAX_PLATFORMS=cpu python bench/int8_plan.py --layers 8 --out int8_plan.json
"""

import argparse
import functools
import json
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import eqx_offload

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import capacity
from llama import Llama, LlamaShape

HOST_DTYPES = {"fp32": None, "bf16": jnp.bfloat16, "int8": jnp.int8}


def llama_shape(layers: int, width: int = 2048, seq: int = 1024, batch: int = 4) -> LlamaShape:
    """The shape `bench/tpu/capacity_chip.py` trains (SwiGLU width 8/3 d, heads of 128)."""
    ffn = (8 * width // 3 + 255) // 256 * 256
    heads = max(1, width // 128)
    return LlamaShape(f"d{width}x{layers}", width, layers, heads, heads, ffn, 32000,
                      seq=seq, batch=batch)


def training_step(shape: LlamaShape, mode: str, host_dtype: Any) -> tuple[Any, tuple[Any, ...]]:
    """One AdamW step in `mode` (`state` or `+params`) with the state kept in
    `host_dtype`, and its abstract arguments."""
    offload = functools.partial(eqx_offload.offloaded, host_dtype=host_dtype)
    adamw = optax.adamw(3e-4, weight_decay=0.1)
    params_on_host = mode == "+params"

    def make() -> Llama:
        model = Llama(shape, jax.random.key(0))
        return capacity._blocks_to_host(model) if params_on_host else model

    model = eqx_offload.checkpoint.filter_eval_shape(make)
    if params_on_host:
        mw = eqx_offload.master_weights(adamw, offload=offload)
        model, state = eqx_offload.checkpoint.filter_eval_shape(mw.init, model)
        update = capacity._master_update(mw)
    else:
        opt = offload(adamw)
        state = eqx_offload.checkpoint.filter_eval_shape(functools.partial(capacity._init, opt),
                                                         model)
        update = capacity._optimizer_update(opt)
    return capacity._one_step(update), (model, state, capacity.abstract_tokens(shape, None))


def plan_row(shape: LlamaShape, mode: str, state: str) -> dict[str, Any]:
    step, args = training_step(shape, mode, HOST_DTYPES[state])
    params = sum(x.size for x in jax.tree.leaves(args[0]) if hasattr(x, "shape"))
    start = time.perf_counter()
    plan = eqx_offload.plan(step, *args, target="v5e")
    return {"mode": mode, "state": state, "params": params,
            "to_device_bytes": plan.bytes_moved("to_device"),
            "to_host_bytes": plan.bytes_moved("to_host"),
            "host_bytes": plan.host_bytes, "device_peak_bytes": plan.device_peak_bytes,
            "fits": plan.fits, "plan_seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=["state", "+params"])
    parser.add_argument("--states", nargs="+", default=list(HOST_DTYPES), choices=list(HOST_DTYPES))
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    shape = llama_shape(args.layers)
    rows = []
    for mode in args.modes:
        for state in args.states:
            rows.append(plan_row(shape, mode, state))
            r = rows[-1]
            print(f"{mode:8} {state:5} {r['params'] / 1e6:7.1f}M params: link "
                  f"{r['to_device_bytes'] / 2**20:9.1f} MiB to the device, "
                  f"{r['to_host_bytes'] / 2**20:9.1f} MiB to host; host "
                  f"{r['host_bytes'] / r['params']:5.2f} B/param; device peak "
                  f"{r['device_peak_bytes'] / 2**30:5.2f} GiB", flush=True)
            if args.out is not None:
                args.out.write_text(json.dumps({
                    "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
                    "shape": shape.__dict__, "target": "v5e", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

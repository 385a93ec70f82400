"""The v5e plan of the `state` training step (AdamW state in host memory) of the
Llama-style decoder (`bench/llama.py`, the proportions of `bench/tpu/capacity_chip.py`),
the normal step against the update inside the backward pass
(`eqx_offload.update_in_backward`): XLA:TPU's device peak, compiled deviceless (libtpu),
nothing allocated. A plan, not a measurement.

    python bench/backward_plan.py [LAYERS ...] [normal|in_backward]
    (default: 8 40 layers, both steps; d=2048, seq 1024, batch 4)

Prints one JSON line per step (its error where XLA:TPU finds it does not fit).
"""

import functools
import json
import os
import sys
import time
from typing import Any

import equinox as eqx
import jax
import optax

sys.path.insert(0, os.path.dirname(__file__))
import capacity  # (bench/)
import eqx_offload
from llama import Llama, llama_loss, LlamaShape


def shape_of(width: int, layers: int, seq: int, batch: int) -> LlamaShape:
    """As `bench/tpu/capacity_chip.py`: heads of 128, SwiGLU of 8/3 x width rounded to
    256, a 32k vocabulary."""
    ffn = (8 * width // 3 + 255) // 256 * 256
    heads = max(1, width // 128)
    return LlamaShape(f"d{width}x{layers}", width, layers, heads, heads, ffn, 32000,
                      seq=seq, batch=batch)


def steps(shape: LlamaShape) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """`{"normal": (step, args), "in_backward": (step, args)}`, abstract arguments."""
    make = functools.partial(Llama, shape, jax.random.key(0))
    model = capacity.shard_abstract(eqx_offload.checkpoint.filter_eval_shape(make), None)
    tokens = capacity.abstract_tokens(shape, None)
    opt = eqx_offload.offloaded(optax.adamw(3e-4, weight_decay=0.1))
    normal_state = eqx_offload.checkpoint.filter_eval_shape(
        lambda m: opt.init(eqx.filter(m, eqx.is_array)), model)
    fused = eqx_offload.update_in_backward(optax.adamw(3e-4, weight_decay=0.1),
                                           layers=lambda m: m.blocks,
                                           offload=eqx_offload.offloaded)
    fused_model, fused_state = eqx_offload.checkpoint.filter_eval_shape(fused.init, model)

    @eqx_offload.filter_jit(donate="all")
    def in_backward(model: Any, state: Any, tokens: Any) -> Any:
        _, model, state = fused.step(llama_loss, model, state, tokens)
        return model, state

    normal = capacity._one_step(capacity._optimizer_update(opt))
    return {"normal": (normal, (model, normal_state, tokens)),
            "in_backward": (in_backward, (fused_model, fused_state, tokens))}


def main(layers: list[int], only: str = "") -> None:
    for n in layers:
        shape = shape_of(2048, n, 1024, 4)
        for name, (step, args) in steps(shape).items():
            if only and name != only:
                continue
            start = time.perf_counter()
            try:
                plan = eqx_offload.plan(step, *args, target="v5e")
            except eqx_offload.errors.PlanError as error:  # (a step that does not fit)
                print(json.dumps({"step": name, "shape": shape.name, "params": shape.params,
                                  "error": str(error)[:400], "jax": jax.__version__}),
                      flush=True)
                continue
            print(json.dumps({
                "step": name, "shape": shape.name, "params": shape.params,
                "device_peak_bytes": plan.device_peak_bytes,
                "host_total_bytes": plan.host_total_bytes,
                "bytes_to_device": plan.bytes_moved("to_device"),
                "bytes_to_host": plan.bytes_moved("to_host"),
                "jax": jax.__version__, "plan_s": round(time.perf_counter() - start, 1),
            }), flush=True)


if __name__ == "__main__":
    names = [a for a in sys.argv[1:] if not a.isdigit()]
    main([int(a) for a in sys.argv[1:] if a.isdigit()] or [8, 40], names[0] if names else "")

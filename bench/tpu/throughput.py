"""Tokens per second of one mode on a chip, at a number of tokens per optimizer step: the
project's Llama (`bench/llama.py`) at sequence 1024, batch 4 (4,096 tokens a
micro-batch), `MICRO` micro-batches per optimizer step summed in a `jax.lax.scan` inside
the step (the accumulation MaxText and Levanter use) and one update. One process per row:

    python bench/tpu/throughput.py MODE WIDTH LAYERS MICRO [STEPS] [SEQ] [BATCH]

MODE is one of `bench/tpu/capacity_chip.py`'s modes. Prints one JSON line (appended to
$OUT/throughput.jsonl when OUT is set): the step's seconds (the first, with its compile,
apart), tokens per second from the median of the rest, the losses and the device's peak.
"""

import os
import statistics
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import capacity_chip  # (bench/tpu/, beside this file)
import eqx_offload
from llama import llama_loss


def main(name: str, width: int, layers: int, micro: int, steps: int, seq: int,
         batch: int) -> dict[str, Any]:
    shape = capacity_chip.shape_of(width, layers, seq, batch)
    record: dict[str, Any] = {"mode": name, "shape": shape.name, "params": shape.params,
                              "micro_batches": micro, "tokens_per_step": micro * batch * seq}
    model, state, grad_step = capacity_chip.start(shape, name, record)

    @eqx_offload.filter_jit(donate=("model", "state"))
    def step(model: Any, state: Any, tokens: jax.Array) -> Any:
        # The first `micro - 1` micro-batches' gradients summed in a scan's carry, the
        # last one's added by the update step (inside the backward pass with `-backward`).
        def one(acc: Any, t: jax.Array) -> Any:
            loss, grads = eqx.filter_value_and_grad(llama_loss)(model, t)
            # (a gradient of weights in host memory is in host memory: summed on the device)
            return jax.tree.map(lambda a, g: a + eqx_offload.to_device(g), acc, grads), loss

        acc, losses = None, jnp.zeros((0,))
        if micro > 1:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype),
                                 eqx.filter(model, eqx.is_array))
            acc, losses = jax.lax.scan(one, zeros, tokens[:-1])
        model, state, loss = grad_step(model, state, tokens[-1], acc)
        return model, state, (losses.sum() + loss) / micro

    tokens = jax.random.randint(jax.random.key(1), (micro, batch, seq + 1), 0, shape.vocab)
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        model, state, loss = step(model, state, tokens)
        losses.append(float(loss))
        times.append(time.perf_counter() - start)
    median = statistics.median(times[1:])
    stats = jax.devices()[0].memory_stats() or {}
    record.update(first_s=times[0], step_s=times[1:], median_s=median,
                  tokens_per_s=record["tokens_per_step"] / median, losses=losses,
                  device_peak=stats.get("peak_bytes_in_use"))
    return record


if __name__ == "__main__":
    args = sys.argv[1:]
    numbers = [int(a) for a in args[1:]] + [4, 1024, 4][len(args) - 4:]
    try:
        result = main(args[0], *numbers)
    except Exception as error:  # noqa: BLE001 - a row that does not run, reported as JSON
        result = {"mode": args[0], "width": numbers[0], "layers": numbers[1],
                  "micro_batches": numbers[2], "error": f"{type(error).__name__}: {str(error)[:600]}"}
    capacity_chip.emit(result, "throughput.jsonl")

"""Tokens per second of one mode on a chip, at a number of tokens per optimizer step: the
project's Llama (`bench/llama.py`) at sequence 1024, batch 4 (4,096 tokens a
micro-batch), `MICRO` micro-batches per optimizer step summed in a `jax.lax.scan` inside
the step (the accumulation MaxText and Levanter use) and one update. One process per row:

    python bench/tpu/throughput.py MODE WIDTH LAYERS MICRO [STEPS]

MODE is one of `bench/tpu/capacity_chip.py`'s modes. Prints one JSON line (appended to
$OUT/throughput.jsonl when OUT is set): the step's seconds (the first, with its compile,
apart), tokens per second from the median of the rest, the losses and the device's peak.
"""

import json
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
import capacity  # (bench/)
import capacity_chip  # (bench/tpu/, beside this file)
import eqx_offload
from llama import Llama, llama_loss


def main(name: str, width: int, layers: int, micro: int, steps: int) -> dict[str, Any]:
    mode, bf16_state = capacity_chip.mode_of(name)
    shape = capacity_chip.shape_of(width, layers, 1024, 4)
    record: dict[str, Any] = {"mode": name, "shape": shape.name, "params": shape.params,
                              "micro_batches": micro, "tokens_per_step": micro * 4 * 1024}
    model = Llama(shape, jax.random.key(0), offload_input=mode.activations_on_host)
    if mode.params_on_host:
        model = capacity._blocks_to_host(model)
    init, update = capacity_chip.optimizer_for(mode, bf16_state)
    model, state = init(model)

    @eqx_offload.filter_jit(donate=("model", "state"))
    def step(model: Any, state: Any, tokens: jax.Array) -> Any:
        def one(acc: Any, t: jax.Array) -> Any:
            loss, grads = eqx.filter_value_and_grad(llama_loss)(model, t)
            return jax.tree.map(jnp.add, acc, grads), loss

        if micro == 1:
            loss, grads = eqx.filter_value_and_grad(llama_loss)(model, tokens[0])
        else:
            zeros = jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_array))
            grads, losses = jax.lax.scan(one, zeros, tokens)
            grads = jax.tree.map(lambda g: g / micro, grads)
            loss = losses.mean()
        model, state = update(model, state, grads)
        return model, state, loss

    tokens = jax.random.randint(jax.random.key(1), (micro, 4, 1024 + 1), 0, shape.vocab)
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
    numbers = [int(a) for a in args[1:]] + [4][len(args) - 4:]
    try:
        result = main(args[0], *numbers)
    except Exception as error:  # noqa: BLE001 - a row that does not run, reported as JSON
        result = {"mode": args[0], "width": numbers[0], "layers": numbers[1],
                  "micro_batches": numbers[2], "error": f"{type(error).__name__}: {str(error)[:600]}"}
    line = json.dumps(result)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "throughput.jsonl"), "a") as f:
            f.write(line + "\n")

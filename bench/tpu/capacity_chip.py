"""One row of the capacity table on a chip: a Llama-style decoder (`bench/llama.py`) in
one mode of `bench/capacity.py`, trained for a number of steps on one batch of random
tokens. One process per run (the device's peak cannot be reset within one):

    python bench/tpu/capacity_chip.py MODE WIDTH LAYERS [STEPS] [SEQ] [BATCH]

MODE is a capacity mode (`fp32`, `bf16`, `state`, `+master`, `+params`, `+activations`)
or `+activations-bf16state` (`+activations` with the state narrowed to bf16 in host
memory). The decoder has Llama's proportions at WIDTH (heads of 128, SwiGLU of 8/3 x
WIDTH rounded to 256, a 32k vocabulary). Prints one JSON line (appended to
$OUT/capacity.jsonl when OUT is set): the parameters, the seconds to make the model, to
init and of each step, the losses, the device's peak, and the process's resident memory.
"""

import functools
import json
import os
import resource
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import capacity  # (bench/, beside this folder)
import eqx_offload
from llama import Llama, llama_loss, LlamaShape


def shape_of(width: int, layers: int, seq: int, batch: int) -> LlamaShape:
    ffn = (8 * width // 3 + 255) // 256 * 256
    heads = max(1, width // 128)
    return LlamaShape(f"d{width}x{layers}", width, layers, heads, heads, ffn, 32000,
                      seq=seq, batch=batch)


def optimizer_for(mode: Any, bf16_state: bool) -> tuple[Any, Any]:
    """`(init, update)`: `init(model) -> (model, state)`, `update(model, state, grads)`."""
    adamw = optax.adamw(3e-4, weight_decay=0.1)
    offload = (functools.partial(eqx_offload.offloaded, host_dtype=jnp.bfloat16)
               if bf16_state else eqx_offload.offloaded)
    if mode.bf16:
        mw = eqx_offload.master_weights(adamw, offload=offload if mode.master_on_host else None)
        return mw.init, capacity._master_update(mw)
    if mode.params_on_host:
        hp = eqx_offload.host_weights_optimizer(adamw, offload=offload if mode.state_on_host else None)
        return (lambda m: (m, hp.init(m))), capacity._master_update(hp)
    opt = offload(adamw) if mode.state_on_host else adamw
    return ((lambda m: (m, opt.init(eqx.filter(m, eqx.is_array)))),
            capacity._optimizer_update(opt))


def mode_of(name: str) -> tuple[Any, bool]:
    """`(capacity mode, bf16 state)` of a MODE argument."""
    return capacity.MODES_BY_NAME[name.removesuffix("-bf16state")], name.endswith("-bf16state")


def resident() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def main(name: str, width: int, layers: int, steps: int, seq: int, batch: int) -> dict[str, Any]:
    mode, bf16_state = mode_of(name)
    shape = shape_of(width, layers, seq, batch)
    record: dict[str, Any] = {"mode": name, "shape": shape.name, "params": shape.params,
                              "seq": seq, "batch": batch, "backend": jax.default_backend()}
    start = time.perf_counter()
    model = Llama(shape, jax.random.key(0), offload_input=mode.activations_on_host)
    if mode.params_on_host:
        model = capacity._blocks_to_host(model)
    jax.block_until_ready(model)
    record["model_s"] = time.perf_counter() - start
    init, update = optimizer_for(mode, bf16_state)
    start = time.perf_counter()
    model, state = init(model)
    jax.block_until_ready((model, state))
    record["init_s"] = time.perf_counter() - start
    record["resident_after_init"] = resident()

    @eqx_offload.filter_jit(donate=("model", "state"))
    def step(model: Any, state: Any, tokens: jax.Array) -> Any:
        loss, grads = eqx.filter_value_and_grad(llama_loss)(model, tokens)
        model, state = update(model, state, grads)
        return model, state, loss

    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, shape.vocab)
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        model, state, loss = step(model, state, tokens)
        losses.append(float(loss))
        times.append(time.perf_counter() - start)
    stats = jax.devices()[0].memory_stats() or {}
    record.update(losses=losses, step_s=times, device_peak=stats.get("peak_bytes_in_use"),
                  device_limit=stats.get("bytes_limit"),
                  resident_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  falls=losses[-1] < losses[0])
    return record


if __name__ == "__main__":
    args = sys.argv[1:]
    numbers = [int(a) for a in args[1:]] + [20, 1024, 4][len(args) - 3:]
    try:
        result = main(args[0], *numbers)
    except Exception as error:  # noqa: BLE001 - a row that does not fit, reported as JSON
        result = {"mode": args[0], "width": numbers[0], "layers": numbers[1],
                  "error": f"{type(error).__name__}: {str(error)[:600]}"}
    line = json.dumps(result)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "capacity.jsonl"), "a") as f:
            f.write(line + "\n")

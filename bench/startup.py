"""Start-up where each array lives, for the capacity modes: `start_for` gives the function
that makes a `Llama` and its AdamW state in a mode (for `eqx_offload.filter_make`, or
`eqx_offload.planner.plan_startup`), and the update of its step.

    python bench/startup.py MODE WIDTH LAYERS [STEPS] [SEQ] [BATCH]

makes the model and its state with `filter_make` in MODE (a capacity mode, or one with
`-bf16state`: the moments in host memory in bf16, the master weights fp32) and trains STEPS steps (default 0) on
one batch of random tokens; prints one JSON line (appended to $OUT/startup.jsonl when OUT
is set): the seconds of the start-up and of each step, the losses, the bytes of the model
and state by memory kind, the process's resident memory after the start-up and at its
peak, and the device's peak where the backend reports one.
"""

import functools
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_offload

sys.path.insert(0, os.path.dirname(__file__))
import capacity  # (bench/)
from llama import Llama, llama_loss, LlamaShape


def llama_shape(width: int, layers: int, seq: int = 1024, batch: int = 4) -> LlamaShape:
    """The project's Llama at `width` (as `bench/tpu/capacity_chip.py`): heads of 128,
    SwiGLU of 8/3 x width rounded to 256, a 32k vocabulary."""
    ffn = (8 * width // 3 + 255) // 256 * 256
    heads = max(1, width // 128)
    return LlamaShape(f"d{width}x{layers}", width, layers, heads, heads, ffn, 32000,
                      seq=seq, batch=batch)


def mode_of(name: str) -> tuple[capacity.CapacityMode, Optional[Any]]:
    """The capacity mode of a name, and the moments' `host_dtype` (`-bf16state`)."""
    base = name.removesuffix("-bf16state")
    return capacity.MODES_BY_NAME[base], (jnp.bfloat16 if base != name else None)


def start_for(shape: LlamaShape, name: str
              ) -> tuple[Callable[[jax.Array], Any], Callable[..., Any]]:
    """`(start, update)`: `start(key) -> (model, state)` makes a `Llama` of `shape` and its
    AdamW state in the mode `name` (what `filter_make` runs), `update(model, state,
    grads) -> (model, state)` its optimizer step."""
    mode, host_dtype = mode_of(name)
    adamw = optax.adamw(3e-4, weight_decay=0.1)
    offload = functools.partial(eqx_offload.offloaded, host_dtype=host_dtype)

    def model_of(key: jax.Array) -> Llama:
        model = Llama(shape, key, offload_input=mode.activations_on_host)
        return capacity._blocks_to_host(model) if mode.params_on_host else model

    if mode.bf16:
        mw = eqx_offload.master_weights(adamw, offload=offload if mode.master_on_host else None)
        return (lambda key: mw.init(model_of(key))), capacity._master_update(mw)
    if mode.params_on_host:
        hp = eqx_offload.host_weights_optimizer(
            adamw, offload=offload if mode.state_on_host else None)

        def start_params(key: jax.Array) -> Any:
            model = model_of(key)
            return model, hp.init(model)
        return start_params, capacity._master_update(hp)
    opt = offload(adamw) if mode.state_on_host else adamw

    def start(key: jax.Array) -> Any:
        model = model_of(key)
        return model, opt.init(eqx.filter(model, eqx.is_array))
    return start, capacity._optimizer_update(opt)


def bytes_by_kind(tree: Any) -> dict[str, int]:
    """The bytes of `tree`'s arrays by memory kind."""
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        if eqx.is_array(x):
            kind = str(x.sharding.memory_kind)
            out[kind] = out.get(kind, 0) + x.size * x.dtype.itemsize
    return out


def resident() -> int:
    """The process's resident memory now (`VmRSS`), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def step_for(update: Callable[..., Any]) -> Any:
    """The donated training step of `update`: `step(model, state, tokens) -> (model,
    state, loss)`."""
    @eqx_offload.filter_jit(donate=("model", "state"))
    def step(model: Any, state: Any, tokens: jax.Array) -> Any:
        loss, grads = eqx.filter_value_and_grad(llama_loss)(model, tokens)
        model, state = update(model, state, grads)
        return model, state, loss
    return step


def train(step: Any, model: Any, state: Any, shape: LlamaShape,
          steps: int) -> tuple[Any, Any, list[float], list[float]]:
    """`steps` calls of `step` (`step_for`) on one batch of random tokens: the model, the
    state, the losses and the seconds of each step."""
    tokens = jax.random.randint(jax.random.key(1), (shape.batch, shape.seq + 1), 0, shape.vocab)
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        model, state, loss = step(model, state, tokens)
        losses.append(float(loss))
        times.append(time.perf_counter() - start)
    return model, state, losses, times


def main(name: str, width: int, layers: int, steps: int = 0, seq: int = 1024,
         batch: int = 4) -> dict[str, Any]:
    shape = llama_shape(width, layers, seq, batch)
    start, update = start_for(shape, name)
    record: dict[str, Any] = {"mode": name, "shape": shape.name, "params": shape.params,
                              "backend": jax.default_backend()}
    began = time.perf_counter()
    model, state = eqx_offload.filter_make(start, jax.random.key(0))
    jax.block_until_ready((model, state))
    record["startup_s"] = time.perf_counter() - began
    record["stored"] = bytes_by_kind((model, state))
    record["resident_after_startup"] = resident()
    model, state, losses, times = train(step_for(update), model, state, shape, steps)
    stats = jax.devices()[0].memory_stats() or {}
    record.update(losses=losses, step_s=times, device_peak=stats.get("peak_bytes_in_use"),
                  resident=resident(),
                  resident_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return record


if __name__ == "__main__":
    argv = sys.argv[1:]
    result = main(argv[0], *[int(a) for a in argv[1:]])
    line = json.dumps(result)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "startup.jsonl"), "a") as f:
            f.write(line + "\n")

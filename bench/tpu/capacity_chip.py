"""One row of the capacity table on a chip: a Llama-style decoder (`bench/llama.py`) in
one mode, made where each array lives (`eqx_offload.filter_make`) and trained for a
number of steps on one batch of random tokens. One process per run (the device's peak
cannot be reset within one):

    python bench/tpu/capacity_chip.py MODE WIDTH LAYERS [STEPS] [SEQ] [BATCH]

MODE is a capacity mode of `bench/capacity.py` (`fp32`, `bf16`, `state`, `+master`,
`+params`, `+activations`), optionally with each parameter stored once (`-once`, after
`+params` or `+activations`: the fp32 weights in host memory are the master weights,
each block cast to bf16 on the device as it is fetched, `host_weights_optimizer`; no
bf16 copy and no `master_weights`), with the moments narrowed in host memory
(`-bf16state`, or `-int8state`: block-wise 8-bit moments; the master weights stay
fp32) and with the stacked blocks updated inside the backward pass (`-backward`:
`eqx_offload.update_in_backward`), in that order (`+activations-once-int8state-backward`:
fp32 master weights with 8-bit moments, everything in host memory). The decoder has Llama's proportions at WIDTH
(heads of 128, SwiGLU of 8/3 x WIDTH rounded to 256, a 32k vocabulary). Prints one JSON
line (appended to $OUT/capacity.jsonl when OUT is set): the parameters, the seconds of
the start-up (model and state together) and of each step, the losses, the bytes stored
by memory kind, the device's peak, and the process's resident memory.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import capacity  # (bench/, beside this folder)
import eqx_offload
from llama import Llama, llama_loss, LlamaShape
from startup import bytes_by_kind, llama_shape as shape_of, resident


STARTED = time.perf_counter()
# The row's seconds (ROW_SECONDS, set by bench/tpu/next.sh): it stops stepping before it
# would pass them, so that a row reports the steps it ran rather than being killed.
SECONDS = float(os.environ.get("ROW_SECONDS", "inf"))
HOST_DTYPES = {"-bf16state": jnp.bfloat16, "-int8state": jnp.int8}


def mode_of(name: str) -> tuple[capacity.CapacityMode, Optional[Any], bool, bool]:
    """`(capacity mode, the state's host_dtype, update in the backward pass, each
    parameter stored once)` of MODE."""
    base = name.removesuffix("-backward")
    backward, dtype = base != name, None
    for suffix, narrow in HOST_DTYPES.items():
        if base.endswith(suffix):
            base, dtype = base.removesuffix(suffix), narrow
    once = base.endswith("-once")
    mode = capacity.MODES_BY_NAME[base.removesuffix("-once")]
    if once and not mode.params_on_host:
        raise ValueError(f"{name}: -once stores the blocks' fp32 weights in host memory: "
                         "use it after +params or +activations.")
    return mode, dtype, backward, once


class InBf16(eqx.Module):
    """A module run in bf16: its floating arrays cast as it is called, on the device
    (the stacked blocks: in `scan_layers`' call, after the layer's fetch)."""

    module: Any

    def __call__(self, *args: Any) -> Any:
        return jax.tree.map(_to_bf16, self.module)(*args)


def _to_bf16(x: Any) -> Any:
    return x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x


def in_bf16(model: Llama) -> Llama:
    """`model` (fp32) computing in bf16: each of its modules wrapped by `InBf16`."""
    wrapped: Llama = eqx.tree_at(
        lambda m: (m.embed, m.blocks, m.norm, m.unembed), model,
        (InBf16(model.embed), InBf16(model.blocks), InBf16(model.norm), InBf16(model.unembed)))
    return wrapped


def optimizer_of(mode: capacity.CapacityMode, host_dtype: Optional[Any],
                 once: bool = False) -> Any:
    """The AdamW of `mode`: plain, `offloaded`, `master_weights` or
    `host_weights_optimizer` (`once`: of the fp32 weights, the master)."""
    adamw = optax.adamw(3e-4, weight_decay=0.1)
    offload = functools.partial(eqx_offload.offloaded, host_dtype=host_dtype)
    if once:
        return eqx_offload.host_weights_optimizer(adamw, offload=offload)
    if mode.bf16:
        return eqx_offload.master_weights(adamw, offload=offload if mode.master_on_host else None)
    if mode.params_on_host:
        return eqx_offload.host_weights_optimizer(
            adamw, offload=offload if mode.state_on_host else None)
    return offload(adamw) if mode.state_on_host else adamw


def trainer(shape: LlamaShape, name: str) -> tuple[Callable[[jax.Array], Any], Callable[..., Any]]:
    """`(start, grad_step)`: `start(key) -> (model, state)` (for `filter_make`) and
    `grad_step(model, state, tokens, accumulated) -> (model, state, loss)`, one update
    from the gradient of `tokens` plus `accumulated` (a gradient sum, or `None`)."""
    mode, host_dtype, backward, once = mode_of(name)
    opt = optimizer_of(mode, host_dtype, once)

    def model_of(key: jax.Array) -> Llama:
        model = Llama(shape, key, offload_input=mode.activations_on_host)
        model = in_bf16(model) if once else model
        return capacity._blocks_to_host(model) if mode.params_on_host else model

    if backward:
        fused = eqx_offload.update_in_backward(opt, layers=lambda m: m.blocks)

        def grad_step(model: Any, state: Any, tokens: jax.Array, acc: Any) -> Any:
            loss, model, state = fused.step(llama_loss, model, state, tokens, accumulated=acc)
            return model, state, loss
        return (lambda key: fused.init(model_of(key))), grad_step

    if mode.bf16 or mode.params_on_host:
        update = capacity._master_update(opt)
        init: Callable[[Any], Any] = (opt.init if mode.bf16 and not once
                                      else lambda m: (m, opt.init(m)))
    else:
        update = capacity._optimizer_update(opt)
        init = lambda m: (m, opt.init(eqx.filter(m, eqx.is_array)))  # noqa: E731

    def normal_step(model: Any, state: Any, tokens: jax.Array, acc: Any) -> Any:
        loss, grads = eqx.filter_value_and_grad(llama_loss)(model, tokens)
        if acc is not None:
            grads = jax.tree.map(lambda a, g: a + eqx_offload.to_device(g), acc, grads)
        model, state = update(model, state, grads)
        return model, state, loss
    return (lambda key: init(model_of(key))), normal_step


def start(shape: LlamaShape, name: str, record: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The model and state of MODE made where each array lives; records the start-up's
    seconds and the bytes by memory kind. Returns `(model, state, grad_step)`."""
    make, grad_step = trainer(shape, name)
    began = time.perf_counter()
    model, state = eqx_offload.filter_make(make, jax.random.key(0))
    jax.block_until_ready((model, state))
    record["startup_s"] = time.perf_counter() - began
    record["stored"] = bytes_by_kind((model, state))
    record["resident_after_startup"] = resident()
    return model, state, grad_step


def main(name: str, width: int, layers: int, steps: int, seq: int, batch: int) -> dict[str, Any]:
    shape = shape_of(width, layers, seq, batch)
    record: dict[str, Any] = {"mode": name, "shape": shape.name, "params": shape.params,
                              "seq": seq, "batch": batch, "backend": jax.default_backend()}
    model, state, grad_step = start(shape, name, record)
    progress(record, "started")
    step = eqx_offload.filter_jit(donate=("model", "state"))(
        lambda model, state, tokens: grad_step(model, state, tokens, None))
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, shape.vocab)
    losses, times = [], []
    for _ in range(steps):
        began = time.perf_counter()
        model, state, loss = step(model, state, tokens)
        losses.append(float(loss))
        times.append(time.perf_counter() - began)
        progress({**record, "losses": losses, "step_s": times}, f"step {len(times)}")
        if time.perf_counter() - STARTED + times[-1] > SECONDS:
            break  # (the next step would pass the row's time: report the steps run)
    stats = jax.devices()[0].memory_stats() or {}
    record.update(losses=losses, step_s=times, device_peak=stats.get("peak_bytes_in_use"),
                  device_limit=stats.get("bytes_limit"), resident=resident(),
                  resident_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  falls=losses[-1] < losses[0])
    return record


def progress(record: dict[str, Any], phase: str) -> None:
    """A progress line (printed, not kept): the row's record so far and its `phase`, so
    that a row stopped by `bench/tpu/next.sh` says how far it came."""
    print(json.dumps({**record, "phase": phase, "resident": resident()}), flush=True)


def emit(result: dict[str, Any], file: str) -> None:
    """Print `result` as one JSON line, and append it to $OUT/`file` when OUT is set."""
    line = json.dumps(result)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], file), "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    args = sys.argv[1:]
    numbers = [int(a) for a in args[1:]] + [20, 1024, 4][len(args) - 3:]
    try:
        result = main(args[0], *numbers)
    except Exception as error:  # noqa: BLE001 - a row that does not fit, reported as JSON
        result = {"mode": args[0], "width": numbers[0], "layers": numbers[1],
                  "error": f"{type(error).__name__}: {str(error)[:600]}"}
    emit(result, "capacity.jsonl")

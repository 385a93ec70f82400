"""The benchmark harness: one model, one table of modes, one builder, one train loop, one
results format. Every script of `bench/` builds on it.

- The model: the project's Llama (`llama.py`) at `llama_shape(width, layers)`.
- The modes: `MODES`, from nothing offloaded (`fp32`) to everything in host memory
  (`+activations`); `mode_of` reads a mode's name with its suffixes.
- The builder: `trainer(shape, name)`, the model and AdamW state made where each array
  lives, and the step's update; the train loop: `train`.
- The results: one JSON record a row (`record`, `run_row`), with the machine's date and
  versions and the step times summarised (`timing`) as the command line's benchmark
  (`python -m eqx_offload bench`) records them: `eqx_offload.cli.measure`.
"""

import dataclasses
import functools
import json
import os
import resource
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.experimental import compute_on

import eqx_offload
from eqx_offload.cli.measure import machine_info, summary

from llama import Llama, llama_loss, LlamaShape


# The function form of `compute_on`: `compute_on2` in JAX 0.10, `compute_on` from 0.11.
host_compute: Callable[..., Any] = (getattr(compute_on, "compute_on2", None)
                                    or compute_on.compute_on)


def llama_shape(width: int, layers: int, seq: int = 1024, batch: int = 4) -> LlamaShape:
    """The project's Llama at `width`: heads of 128, a SwiGLU of 8/3 x `width` rounded to
    256, a 32k vocabulary."""
    ffn = (8 * width // 3 + 255) // 256 * 256
    heads = max(1, width // 128)
    return LlamaShape(f"d{width}x{layers}", width, layers, heads, heads, ffn, 32000,
                      seq=seq, batch=batch)


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way to train: what is in bf16 and what waits in host memory.

    **Fields:** `name`, `what` (for a person); `bf16` (bf16 compute weights with fp32
    master weights, `eqx_offload.master_weights`); `master_on_host` (the master
    weights, and the state, in host memory); `state_on_host` (the optimizer state in
    host memory, `eqx_offload.offloaded`); `params_on_host` (the blocks' weights in
    host memory, fetched a layer at a time by `scan_layers`); `activations_on_host`
    (each block's input kept in host memory for the backward pass); `after` (the
    modes that keep at least as much on the device: the capacity search for this one
    starts where theirs ended).
    """

    name: str
    what: str
    bf16: bool = False
    master_on_host: bool = False
    state_on_host: bool = False
    params_on_host: bool = False
    activations_on_host: bool = False
    after: tuple[str, ...] = ()


MODES: tuple[Mode, ...] = (
    Mode("fp32", "fp32 weights and AdamW state, all on the device"),
    Mode("bf16", "bf16 compute weights, fp32 master weights and state on the device",
         bf16=True),
    Mode("state", "fp32 weights on the device, AdamW state in host memory",
         state_on_host=True, after=("fp32",)),
    Mode("+master", "bf16 weights on the device, fp32 master weights and state in host "
         "memory", bf16=True, master_on_host=True, state_on_host=True, after=("bf16", "state")),
    Mode("+params", "+ the blocks' bf16 weights in host memory", bf16=True,
         master_on_host=True, state_on_host=True, params_on_host=True, after=("+master",)),
    Mode("+activations", "+ each block's input in host memory", bf16=True,
         master_on_host=True, state_on_host=True, params_on_host=True,
         activations_on_host=True, after=("+params",)),
)
"""The modes, from nothing offloaded to everything. A name may add, in this order,
`-once` (after `+params` or `+activations`: each parameter stored once, the blocks' fp32
weights in host memory are the master weights, cast to bf16 on the device as each is
fetched; `host_weights_optimizer`, no bf16 copy), the moments narrowed in host memory
(`HOST_DTYPES`) and `-backward` (the stacked blocks updated inside the backward pass,
`eqx_offload.update_in_backward`): `+activations-once-int8state-backward`."""

MODES_BY_NAME = {m.name: m for m in MODES}
HOST_DTYPES = {"-bf16state": jnp.bfloat16, "-int8state": jnp.int8}


class Spec(NamedTuple):
    """A mode's name read by `mode_of`: the `Mode`, the moments' `host_dtype`, whether
    the blocks are updated inside the backward pass, and whether each parameter is
    stored once."""

    mode: Mode
    host_dtype: Optional[Any] = None
    backward: bool = False
    once: bool = False


def mode_of(name: str) -> Spec:
    """The `Spec` of a mode's name, e.g. `+activations-once-int8state-backward`."""
    base = name.removesuffix("-backward")
    dtype = None
    for suffix, narrow in HOST_DTYPES.items():
        if base.endswith(suffix):
            base, dtype = base.removesuffix(suffix), narrow
    once = base.endswith("-once")
    mode = MODES_BY_NAME.get(base.removesuffix("-once"))
    if mode is None:
        raise ValueError(f"{name}: not a mode; a mode is one of {', '.join(MODES_BY_NAME)}, "
                         "then -once, -bf16state or -int8state, and -backward")
    if once and not mode.params_on_host:
        raise ValueError(f"{name}: -once stores the blocks' fp32 weights in host memory: "
                         "use it after +params or +activations.")
    return Spec(mode, dtype, name.endswith("-backward"), once)


def blocks_to_host(model: Llama) -> Llama:
    """`model` with its stacked blocks' weights in host memory."""
    moved: Llama = eqx.tree_at(lambda m: m.blocks, model, replace_fn=eqx_offload.to_host)
    return moved


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


def model_of(shape: LlamaShape, spec: Spec, key: jax.Array) -> Llama:
    """The Llama of `shape` placed as `spec` says."""
    model = Llama(shape, key, offload_input=spec.mode.activations_on_host)
    model = in_bf16(model) if spec.once else model
    return blocks_to_host(model) if spec.mode.params_on_host else model


def optimizer_of(spec: Spec) -> Any:
    """The AdamW of `spec`: plain, `offloaded`, `master_weights` or
    `host_weights_optimizer` (with `once`: of the fp32 weights, the master)."""
    mode = spec.mode
    adamw = optax.adamw(3e-4, weight_decay=0.1)
    offload = functools.partial(eqx_offload.offloaded, host_dtype=spec.host_dtype)
    if spec.once:
        return eqx_offload.host_weights_optimizer(adamw, offload=offload)
    if mode.bf16:
        return eqx_offload.master_weights(adamw, offload=offload if mode.master_on_host else None)
    if mode.params_on_host:
        return eqx_offload.host_weights_optimizer(
            adamw, offload=offload if mode.state_on_host else None)
    return offload(adamw) if mode.state_on_host else adamw


class Builder(NamedTuple):
    """`init(model) -> (model, state)` and `update(model, state, grads) -> (model,
    state)` of an optimizer of `optimizer_of`."""

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], Any]


def builder(spec: Spec, opt: Any) -> Builder:
    """The `Builder` of `opt`, the optimizer of `spec`."""
    mode = spec.mode
    if mode.bf16 or mode.params_on_host:  # (`update(grads, state, model)`)
        init = opt.init if mode.bf16 and not spec.once else lambda m: (m, opt.init(m))
        return Builder(init, lambda model, state, grads: opt.update(grads, state, model))

    def update(model: Any, state: Any, grads: Any) -> Any:
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx_offload.apply_updates(model, updates), state
    return Builder(lambda m: (m, opt.init(eqx.filter(m, eqx.is_array))), update)


class Trainer(NamedTuple):
    """`start(key) -> (model, state)`, for `eqx_offload.filter_make`, and
    `grad_step(model, state, tokens, accumulated) -> (model, state, loss)`: one update
    from the gradient of `tokens` plus `accumulated` (a gradient sum, or `None`)."""

    start: Callable[[jax.Array], Any]
    grad_step: Callable[..., Any]


def trainer(shape: LlamaShape, name: str) -> Trainer:
    """The `Trainer` of the mode `name` (see `mode_of`) for a Llama of `shape`."""
    spec = mode_of(name)
    opt = optimizer_of(spec)
    if spec.backward:
        fused = eqx_offload.update_in_backward(opt, layers=lambda m: m.blocks)

        def fused_step(model: Any, state: Any, tokens: jax.Array, acc: Any) -> Any:
            loss, model, state = fused.step(llama_loss, model, state, tokens, accumulated=acc)
            return model, state, loss
        return Trainer(lambda key: fused.init(model_of(shape, spec, key)), fused_step)
    init, update = builder(spec, opt)

    def grad_step(model: Any, state: Any, tokens: jax.Array, acc: Any) -> Any:
        loss, grads = eqx.filter_value_and_grad(llama_loss)(model, tokens)
        if acc is not None:  # (a gradient of weights in host memory is there: summed here)
            grads = jax.tree.map(lambda a, g: a + eqx_offload.to_device(g), acc, grads)
        model, state = update(model, state, grads)
        return model, state, loss
    return Trainer(lambda key: init(model_of(shape, spec, key)), grad_step)


def step_of(grad_step: Callable[..., Any], micro: int = 1) -> Any:
    """The donated step `step(model, state, tokens) -> (model, state, loss)`. With
    `micro > 1`, `tokens` has a leading axis of `micro` micro-batches: the first
    `micro - 1` gradients summed in a `jax.lax.scan` (MaxText's and Levanter's
    accumulation), the last one's added by `grad_step`, and one update."""
    @eqx_offload.filter_jit(donate=("model", "state"))
    def step(model: Any, state: Any, tokens: jax.Array) -> Any:
        if micro == 1:
            return grad_step(model, state, tokens, None)

        def one(acc: Any, t: jax.Array) -> Any:
            loss, grads = eqx.filter_value_and_grad(llama_loss)(model, t)
            return jax.tree.map(lambda a, g: a + eqx_offload.to_device(g), acc, grads), loss

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype),
                             eqx.filter(model, eqx.is_array))
        acc, losses = jax.lax.scan(one, zeros, tokens[:-1])
        model, state, loss = grad_step(model, state, tokens[-1], acc)
        return model, state, (losses.sum() + loss) / micro
    return step


def tokens_of(shape: LlamaShape, micro: int = 1) -> jax.Array:
    """One batch of random token ids (`micro` of them stacked where `micro > 1`)."""
    lead = (micro,) if micro > 1 else ()
    return jax.random.randint(jax.random.key(1), (*lead, shape.batch, shape.seq + 1), 0,
                              shape.vocab)


def train(step: Any, model: Any, state: Any, tokens: jax.Array, steps: int,
          seconds: float = float("inf"),
          progress: Optional[Callable[[list[float], list[float]], None]] = None
          ) -> tuple[Any, Any, list[float], list[float]]:
    """Up to `steps` calls of `step` (`step_of`) on `tokens`: the model, the state, the
    losses and each step's seconds, stopped before a step would end past `seconds` from
    now (a row reports the steps it ran); `progress(losses, times)` after each step."""
    began, losses, times = time.perf_counter(), list[float](), list[float]()
    for _ in range(steps):
        start = time.perf_counter()
        model, state, loss = step(model, state, tokens)
        losses.append(float(loss))
        times.append(time.perf_counter() - start)
        if progress is not None:
            progress(losses, times)
        if time.perf_counter() - began + times[-1] > seconds:
            break
    return model, state, losses, times


def bytes_by_kind(tree: Any) -> dict[str, int]:
    """The bytes of `tree`'s arrays (or `jax.ShapeDtypeStruct`s) by memory kind."""
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct):
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


def record(**fields: Any) -> dict[str, Any]:
    """A result: `fields`, the device's peak, the process's resident memory now and at its
    peak, and `machine` (the date, versions and device, as the CLI's benchmark records)."""
    stats = jax.devices()[0].memory_stats() or {}
    return {**fields, "device_peak": stats.get("peak_bytes_in_use"),
            "device_limit": stats.get("bytes_limit"), "resident": resident(),
            "resident_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "machine": machine()}


@functools.cache
def machine() -> dict[str, Any]:
    """`machine_info()`, once: a row asks for it before it fills host memory, since it
    forks (`uname`), and a fork of a process holding tens of GB counts twice in `ps`."""
    return machine_info()


def run_row(file: str, what: dict[str, Any], fun: Callable[[], dict[str, Any]]) -> None:
    """Print `fun()`'s result as one JSON line, and append it to `$OUT/{file}.jsonl` when
    OUT is set; an exception (a row that does not fit) is the row's result, `what` with
    its `error`."""
    try:
        result = fun()
    except Exception as error:  # noqa: BLE001 - reported as the row's JSON
        result = {**what, "error": f"{type(error).__name__}: {str(error)[:600]}"}
    line = json.dumps(result)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{file}.jsonl"), "a") as f:
            f.write(line + "\n")


def timing(times: list[float], per_step: int) -> dict[str, Any]:
    """The first step's seconds (its compile) apart, the rest summarised as the command
    line's benchmark does (`steps`), and `per_step / median` a second."""
    if not times:
        return {}
    steps = summary(times[1:] or times)
    return {"first_s": times[0], "steps": steps, "median_s": steps["median"],
            "tokens_per_s": per_step / steps["median"]}

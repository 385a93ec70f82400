"""Loss curves of 8-bit optimizer state against fp32 state, on the CPU.

A byte-level language model (the project's Llama, `bench/llama.py`, 2 layers of width
128, vocabulary 256, 64 bytes a sequence, 16 a batch) learns Python's own documentation (`pydoc_data.topics`, shipped with
CPython: 0.46 MB of English and code), trained with AdamW from the same initialisation on
the same batches with each optimizer state:

- `fp32`: `eqx_offload.offloaded(adamw)` (bitwise plain AdamW);
- `int8`: `eqx_offload.offloaded(adamw, host_dtype=jnp.int8)` (block-wise 8-bit moments);
- `bf16`: `eqx_offload.offloaded(adamw, host_dtype=jnp.bfloat16)`, for comparison;
- `once-int8`: each parameter stored once (docs/capacity.md): the blocks' fp32 weights in
  host memory are the master, each layer cast to bf16 on the device as it is called (the
  whole model computes in bf16), 8-bit moments, updated inside the backward pass
  (`update_in_backward(host_weights_optimizer(adamw, offload=8-bit offloaded))`).

Writes `int8_curves.json` (the training loss of every step, the held-out loss every
`--eval-every` steps) and `int8_curves.png` if matplotlib is installed:

    JAX_PLATFORMS=cpu python bench/results/cpu-2026-12-06/int8_curves.py --steps 3000 --out docs/bench/cpu
"""

import argparse
import functools
import json
import pathlib
import platform
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_offload

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # (bench/)
from harness import in_bf16
from llama import Llama, llama_loss, LlamaShape


SHAPE = LlamaShape("char", width=128, layers=2, heads=4, kv_heads=4, ffn=384, vocab=256,
                   seq=64, batch=16)
MODES = {
    "fp32": {},
    "int8": {"host_dtype": jnp.int8},
    "bf16": {"host_dtype": jnp.bfloat16},
    "once-int8": {"host_dtype": jnp.int8},
}


def corpus() -> tuple[np.ndarray, np.ndarray]:
    """The bytes of `pydoc_data.topics` (sorted by topic), 95% to train on and 5% held out."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode()
    data = np.frombuffer(text, np.uint8).astype(np.int32)
    split = int(len(data) * 0.95)
    return data[:split], data[split:]


def batches(data: np.ndarray, count: int, seed: int) -> np.ndarray:
    """`count` batches of `SHAPE.batch` windows of `SHAPE.seq + 1` bytes, at random offsets."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(data) - SHAPE.seq - 1, (count, SHAPE.batch))
    return data[starts[..., None] + np.arange(SHAPE.seq + 1)]


def train(mode: str, steps: int, eval_every: int, lr: float) -> dict[str, Any]:
    """The losses of `steps` AdamW steps with `mode`'s optimizer state."""
    train_data, held_out = corpus()
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, steps // 20, steps, lr / 10)
    adamw = optax.adamw(schedule, weight_decay=0.1)
    model = Llama(SHAPE, jax.random.key(0))
    if mode.startswith("once-"):  # the stored-once composition of docs/capacity.md
        offload = functools.partial(eqx_offload.offloaded, **MODES[mode])
        fused = eqx_offload.update_in_backward(
            eqx_offload.host_weights_optimizer(adamw, offload=offload),
            layers=lambda m: m.blocks)
        model = eqx.tree_at(lambda m: m.blocks, in_bf16(model), replace_fn=eqx_offload.to_host)
        model, state = fused.init(model)

        @eqx_offload.filter_jit(donate="all-except-first")
        def step(tokens: jax.Array, model: Any, state: Any) -> tuple[Any, Any, jax.Array]:
            loss, model, state = fused.step(llama_loss, model, state, tokens)
            return model, state, loss
    else:
        opt = eqx_offload.offloaded(adamw, **MODES[mode])
        state = opt.init(eqx.filter(model, eqx.is_array))

        @eqx_offload.filter_jit(donate="all-except-first")
        def step(tokens: jax.Array, model: Any, state: Any) -> tuple[Any, Any, jax.Array]:
            loss, grads = eqx.filter_value_and_grad(llama_loss)(model, tokens)
            updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state, loss

    evaluate = eqx.filter_jit(lambda model, tokens: llama_loss(model, tokens))
    held = jnp.asarray(batches(held_out, 8, seed=1))
    losses, held_losses = [], []
    start = time.perf_counter()
    for i, tokens in enumerate(batches(train_data, steps, seed=0)):
        model, state, loss = step(jnp.asarray(tokens), model, state)
        losses.append(loss)
        if (i + 1) % eval_every == 0 or i + 1 == steps:
            held_losses.append((i + 1, float(np.mean([evaluate(model, b) for b in held]))))
            print(f"{mode}: step {i + 1}, loss {float(loss):.4f}, held-out "
                  f"{held_losses[-1][1]:.4f}", file=sys.stderr, flush=True)
    return {"mode": mode, "options": {k: str(v) for k, v in MODES[mode].items()},
            "losses": [float(x) for x in jax.device_get(losses)],
            "held_out": held_losses, "seconds": time.perf_counter() - start}


def smoothed(values: list[float], window: int) -> np.ndarray:
    return np.convolve(values, np.ones(window) / window, mode="valid")


def plot(results: list[dict[str, Any]], path: pathlib.Path) -> bool:
    """The curves as a PNG (training loss smoothed over 50 steps; held-out loss)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        window = min(50, len(r["losses"]))
        left.plot(np.arange(window, len(r["losses"]) + 1), smoothed(r["losses"], window),
                  label=r["mode"])
        steps, held = zip(*r["held_out"])
        right.plot(steps, held, marker=".", label=r["mode"])
    left.set(title="training loss (mean of 50 steps)", xlabel="step", ylabel="nats/byte")
    right.set(title="held-out loss", xlabel="step")
    for axes in (left, right):
        axes.legend()
        axes.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--keep", action="store_true",
                        help="keep the other modes' results already in the output file")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
            "eqx_offload": eqx_offload.__version__, "python": platform.python_version(),
            "backend": jax.default_backend(), "shape": SHAPE.__dict__, "steps": args.steps,
            "lr": args.lr, "text": "pydoc_data.topics"}
    results: list[dict[str, Any]] = []
    previous = args.out / "int8_curves.json"
    if args.keep and previous.exists():
        results = [r for r in json.loads(previous.read_text())["results"]
                   if r["mode"] not in args.modes and len(r["losses"]) == args.steps]
    for mode in args.modes:  # (written after each mode)
        results.append(train(mode, args.steps, args.eval_every, args.lr))
        (args.out / "int8_curves.json").write_text(json.dumps({**meta, "results": results}))
        plotted = plot(results, args.out / "int8_curves.png")
    for r in results:
        print(f"{r['mode']}: final training loss (mean of the last 100 steps) "
              f"{np.mean(r['losses'][-100:]):.4f}, held-out {r['held_out'][-1][1]:.4f}, "
              f"{r['seconds']:.0f} s")
    print("wrote", args.out / "int8_curves.json", "and the PNG" if plotted else "(no matplotlib)")


if __name__ == "__main__":
    main()

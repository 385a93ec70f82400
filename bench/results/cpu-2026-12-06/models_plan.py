"""XLA's GPU plan (H200, compiled without a GPU) of the benchmark's transformer with each
offload technique inside the model, and all of them together.

    python bench/models_plan.py [--quick] [--out docs/bench/gpu/models_plan.json]

The model is the benchmark's `TransformerLM` block (eqx_offload/cli/models.py) with its
blocks stacked (`eqx.filter_vmap`) and run by `jax.lax.scan` (the Equinox idiom that
parameter offload needs). Every step is one AdamW training step under
`eqx_offload.filter_jit(donate="all")`. The numbers are XLA's plan for the target (its
buffer assignment and schedule), not a measurement on a GPU.
"""

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_offload
from eqx_offload.cli import models



MiB = 1 << 20


class ScannedLM(eqx.Module):
    """`TransformerLM` with its blocks stacked: one `Block` whose array leaves have a
    leading axis of length `layers`."""

    embed: eqx.nn.Embedding
    position: eqx.nn.Embedding
    blocks: models.Block
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear
    remat: bool = eqx.field(static=True)
    offload_input: bool = eqx.field(static=True)

    def __init__(self, shape: models.LMShape, key: jax.Array, remat: bool = False,
                 offload_input: bool = False) -> None:
        ke, kp, ku, kb = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(shape.vocab, shape.width, key=ke)
        self.position = eqx.nn.Embedding(shape.seq, shape.width, key=kp)
        self.blocks = eqx.filter_vmap(lambda k: models.Block(shape.width, shape.heads, k))(
            jax.random.split(kb, shape.layers))
        self.norm = eqx.nn.LayerNorm(shape.width)
        self.unembed = eqx.nn.Linear(shape.width, shape.vocab, use_bias=False, key=ku)
        self.remat = remat
        self.offload_input = offload_input

    def __call__(self, tokens: jax.Array) -> jax.Array:
        seq = tokens.shape[0]
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.position)(jnp.arange(seq))
        mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))

        def call(block: models.Block, x: jax.Array) -> jax.Array:
            return block(x, mask)

        if self.remat:
            x = eqx_offload.scan_layers(self.blocks, x, call, offload_input=self.offload_input)
        else:
            dynamic, static = eqx.partition(self.blocks, eqx.is_array)
            x = jax.lax.scan(lambda x, d: (call(eqx.combine(d, static), x), None), x, dynamic)[0]
        return jax.vmap(self.unembed)(jax.vmap(self.norm)(x))


def batched_loss(model: Any, tokens: jax.Array) -> jax.Array:
    return models.lm_loss(model, tokens).astype(jnp.float32)


def blocks_on_host(model: ScannedLM) -> Any:
    return eqx.tree_at(lambda m: m.blocks, model, replace_fn=eqx_offload.to_host)


@dataclasses.dataclass
class Case:
    name: str
    what: str
    model: Any
    state: Any
    step: Callable[..., Any]

    @property
    def host_weights(self) -> bool:
        return any(x.sharding.memory_kind == "pinned_host"
                   for x in jax.tree.leaves(eqx.filter(self.model, eqx.is_array)))


def optimizer_step(opt: Any) -> Callable[..., Any]:
    @eqx_offload.filter_jit(donate="all")
    def step(model: Any, state: Any, tokens: jax.Array) -> Any:
        grads = eqx.filter_grad(batched_loss)(model, tokens)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx_offload.apply_updates(model, updates), state
    return step


def master_step(mw: Any) -> Callable[..., Any]:
    """The step of `master_weights` or `host_weights_optimizer`: `update(grads, state, model)`."""
    @eqx_offload.filter_jit(donate="all")
    def step(model: Any, state: Any, tokens: jax.Array) -> Any:
        grads = eqx.filter_grad(batched_loss)(model, tokens)
        return mw.update(grads, state, model)
    return step


def cases(shape: models.LMShape, group_bytes: int) -> Iterator[Case]:
    """The steps to plan, one at a time (each holds a model and a state in CPU memory)."""
    key = jax.random.key(0)
    adamw = optax.adamw(1e-3)
    streamed = functools.partial(eqx_offload.offloaded, group_bytes=group_bytes)

    def case(name: str, what: str, model: Any, opt: Any) -> Case:
        return Case(name, what, model, opt.init(eqx.filter(model, eqx.is_array)),
                    optimizer_step(opt))

    def lm(remat: bool = False, offload_input: bool = False) -> ScannedLM:
        return ScannedLM(shape, key, remat=remat, offload_input=offload_input)

    yield case("plain", "fp32, no remat, everything on the device", lm(), adamw)
    yield case("state", "optimizer state in host memory, streamed update", lm(), streamed(adamw))
    yield case("remat", "remat of each block, nothing offloaded", lm(True), adamw)
    yield case("activations", "remat + each block's input in host memory", lm(True, True), adamw)
    def host_params_case(name: str, what: str, model: Any, offload: Any) -> Case:
        hp = eqx_offload.host_weights_optimizer(adamw, offload=offload)
        return Case(name, what, model, hp.init(model), master_step(hp))

    yield host_params_case("params", "remat + blocks' weights in host memory (state on device)",
                           blocks_on_host(lm(True)), None)
    yield host_params_case("params+state", "remat + blocks' weights and the state in host "
                           "memory, streamed", blocks_on_host(lm(True)), streamed)
    yield host_params_case("all", "weights, activations and state in host memory, streamed "
                           "update", blocks_on_host(lm(True, True)), streamed)
    # Master weights: bf16 compute model on the device, fp32 master + state on host.
    mw = eqx_offload.master_weights(adamw, offload=streamed)
    yield Case("master", "bf16 compute weights, fp32 master weights + state in host memory",
               *mw.init(lm()), master_step(mw))
    mw = eqx_offload.master_weights(adamw, offload=streamed)
    yield Case("master+all", "master weights + bf16 blocks' weights and activations in host memory",
               *mw.init(blocks_on_host(lm(True, True))), master_step(mw))


PREFETCH_OPTIONS = {"xla_gpu_experimental_parallel_async_compute_limit": 32}
"""XLA's GPU scheduler keeps one asynchronous computation in flight by default; the
weight fetches of a layer (one per host leaf: 12 for a `Block`) are such computations
(dynamic-slice fusions reading host memory), so by default they run one after the other
before the layer's kernels. With room for all of them, each spans the layer's compute."""


def weight_fetches(plan: Any) -> list[Any]:
    """The plan's fetches of one loop iteration's slice of a host-resident stacked
    array (asynchronous dynamic-slices from host memory): the layers' weights, and
    with `offload_input` the layer inputs the backward pass reads back."""
    return [c for c in plan.copies_to("to_device") if c.name.startswith("dynamic-slice-start")]


def plan_all(shape: models.LMShape, group_bytes: int) -> dict[str, Any]:
    tokens = models.token_batches(shape, 1, seed=0)[0]
    results: dict[str, Any] = {"shape": dataclasses.asdict(shape), "params": shape.params,
                               "group_bytes": group_bytes, "cases": {}}
    for case in cases(shape, group_bytes):
        start = time.perf_counter()
        options = PREFETCH_OPTIONS if case.host_weights else {}
        plan = eqx_offload.planner.gpu_plan(case.step, case.model, case.state, tokens, target="h200",
                                    compiler_options=options)
        to_device = plan.copies_to("to_device")
        fetches = weight_fetches(plan) if case.host_weights else []
        kernels = sorted(c.kernels for c in fetches)
        results["cases"][case.name] = {
            "what": case.what,
            "device_peak_bytes": plan.device_peak_bytes,
            "argument_bytes": plan.argument_bytes,
            "temp_bytes": plan.temp_bytes,
            "host_bytes": plan.host_bytes,
            "copies_to_device": len(to_device),
            "bytes_to_device": sum(c.nbytes for c in to_device),
            "copies_to_host": len(plan.copies_to("to_host")),
            "overlap_to_device": plan.overlapped_fraction("to_device"),
            "overlap_to_device_bytes": plan.overlapped_fraction("to_device", by="bytes"),
            "compiler_options": options,
            "weight_fetches": len(fetches),
            "weight_fetches_overlapped": sum(c.overlapped for c in fetches),
            "weight_fetch_kernels_min": kernels[0] if kernels else None,
            "weight_fetch_kernels_median": kernels[len(kernels) // 2] if kernels else None,
            "compile_s": round(time.perf_counter() - start, 1),
        }
        print(f"{case.name:13s} peak {plan.device_peak_bytes / MiB:9.1f} MiB  host "
              f"{plan.host_bytes / MiB:9.1f} MiB  to-device copies {len(to_device):4d} "
              f"overlap {plan.overlapped_fraction('to_device'):.2f}  weight fetches "
              f"{sum(c.overlapped for c in fetches)}/{len(fetches)} kernels {kernels}",
              file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        shape = models.LMShape(vocab=256, width=64, layers=2, heads=2, seq=32, batch=2)
    else:
        shape = models.LMShape(vocab=8192, width=768, layers=12, heads=12, seq=512, batch=8)
    results = plan_all(shape, group_bytes=8 * MiB)
    text = json.dumps(results, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()

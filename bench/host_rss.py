"""Where the host's resident memory goes: the process's `VmRSS` after each thing that
makes arrays in `pinned_host`, against the bytes those arrays hold. One process per run
(the runtime's host allocator keeps what it freed):

    python bench/host_rss.py primitives MIB
    python bench/host_rss.py startup MODE WIDTH LAYERS [STEPS]

`primitives`: a MIB array in host memory made by a jit with host `out_shardings`, by
host compute (as `filter_make` allocates stacked leaves), written a layer at a time
into a donated host buffer (8 layers), rewritten by a donated step, deleted and made
again. `startup`: `eqx_offload.filter_make` of MODE (`harness.MODES`), then STEPS steps
(default 2). Prints one JSON record (appended to $OUT/host_rss.jsonl when OUT is set):
each stage's resident memory above the start, and the bytes in host memory then.
"""

import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

import eqx_offload

sys.path.insert(0, os.path.dirname(__file__))
import harness  # (bench/)


class Stages:
    """The stages recorded: `(name, resident above the start, bytes in host memory,
    seconds)`."""

    def __init__(self) -> None:
        jnp.zeros(()).block_until_ready()  # (the runtime started)
        self.start = harness.resident()
        self.began = time.perf_counter()
        self.rows: list[dict[str, Any]] = []

    def __call__(self, name: str, alive: Any) -> None:
        jax.block_until_ready(alive)
        self.rows.append({"stage": name,
                          "rss_gb": round((harness.resident() - self.start) / 1e9, 3),
                          "host_gb": round(harness.bytes_by_kind(alive).get("pinned_host", 0)
                                           / 1e9, 3),
                          "s": round(time.perf_counter() - self.began, 2)})
        print(json.dumps(self.rows[-1]), flush=True)


def primitives(mib: int) -> dict[str, Any]:
    stages = Stages()
    host = jax.sharding.make_single_device_sharding(jax.devices()[0], memory_kind="pinned_host")
    shape = (8, mib * 2**20 // 8 // 4)  # float32, 8 layers
    a = jax.jit(lambda: jnp.ones(shape), out_shardings=host)()
    stages("jit out_shardings", [a])
    b = jax.jit(harness.host_compute(lambda: jnp.zeros(shape), compute_type="device_host",
                                     out_memory_spaces=jax.memory.Space.Host))()
    stages("host compute zeros", [a, b])

    def write_row(buf: Any, i: Any) -> Any:
        row = jnp.full((1, shape[1]), i, jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(buf, eqx_offload.to_host(row), i, 0)
    write = jax.jit(write_row, donate_argnums=0)
    for i in range(8):
        b = write(b, jnp.int32(i))
    stages("8 layer writes into the donated buffer", [a, b])

    def double(x: Any) -> Any:
        return eqx_offload.to_host(eqx_offload.to_device(x) * 2.0)
    step = jax.jit(double, donate_argnums=0, out_shardings=host)
    for _ in range(3):
        b = step(b)
    stages("3 donated steps", [a, b])
    c = jax.jit(double, out_shardings=host)(a)  # (not donated: a new host buffer)
    stages("a step into a new buffer", [a, b, c])
    a.delete()
    c.delete()
    stages("two deleted", [b])
    d = jax.jit(lambda: jnp.ones(shape), out_shardings=host)()
    stages("made again", [b, d])
    return harness.record(run="primitives", mib=mib, stages=stages.rows)


def startup(name: str, width: int, layers: int, steps: int = 2) -> dict[str, Any]:
    stages = Stages()
    shape = harness.llama_shape(width, layers)
    start, grad_step = harness.trainer(shape, name)
    model, state = eqx_offload.filter_make(start, jax.random.key(0))
    stages("filter_make", (model, state))
    step, tokens = harness.step_of(grad_step), harness.tokens_of(shape)
    for n in range(steps):
        model, state, loss = step(model, state, tokens)
        stages(f"step {n + 1} (loss {float(loss):.3f})", (model, state))
    return harness.record(run="startup", mode=name, shape=shape.name, params=shape.params,
                          stages=stages.rows)


if __name__ == "__main__":
    args = sys.argv[1:]
    harness.run_row("host_rss", {"run": " ".join(args)}, lambda: (
        primitives(int(args[1])) if args[0] == "primitives"
        else startup(args[1], *map(int, args[2:]))))

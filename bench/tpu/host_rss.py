"""Where the host's resident memory goes on a chip: the process's `VmRSS` after each
thing that makes arrays in `pinned_host`, against the bytes those arrays hold. One
process per run (the runtime's host allocator keeps what it freed):

    python bench/tpu/host_rss.py primitives MIB
    python bench/tpu/host_rss.py startup MODE WIDTH LAYERS [STEPS]

`primitives`: a MIB array in host memory made by a jit with host `out_shardings`, by
host compute (`compute_on("device_host")`, as `filter_make` allocates stacked leaves),
written a layer at a time into a donated host buffer (8 layers), rewritten by a donated
step, deleted and made again. `startup`: `eqx_offload.filter_make`'s programs of
`bench/tpu/capacity_chip.py`'s MODE run one at a time, then STEPS steps (default 2).
Prints one JSON line (appended to $OUT/host_rss.jsonl when OUT is set): each stage's
resident memory above the start, and the bytes in host memory then.
"""

import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import capacity_chip  # (bench/tpu/, beside this file)
import eqx_offload
from eqx_offload._core.compat import host_compute
from eqx_offload._models import make
from startup import resident


def host_bytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)
               and not x.is_deleted() and x.sharding.memory_kind == "pinned_host")


class Stages:
    """The stages recorded: `(name, resident above the start, bytes in host memory,
    seconds)`."""

    def __init__(self) -> None:
        jnp.zeros(()).block_until_ready()  # (the runtime started)
        self.start = resident()
        self.began = time.perf_counter()
        self.rows: list[dict[str, Any]] = []

    def __call__(self, name: str, alive: Any) -> None:
        jax.block_until_ready(alive)
        self.rows.append({"stage": name, "rss_gb": round((resident() - self.start) / 1e9, 3),
                          "host_gb": round(host_bytes(alive) / 1e9, 3),
                          "s": round(time.perf_counter() - self.began, 2)})
        print(json.dumps(self.rows[-1]), flush=True)


def primitives(mib: int) -> dict[str, Any]:
    stages = Stages()
    device = jax.devices()[0]
    host = jax.sharding.make_single_device_sharding(device, memory_kind="pinned_host")
    shape = (8, mib * 2**20 // 8 // 4)  # float32, 8 layers
    a = jax.jit(lambda: jnp.ones(shape), out_shardings=host)()
    stages("jit out_shardings", [a])
    b = jax.jit(host_compute(lambda: jnp.zeros(shape), compute_type="device_host",
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
    return {"run": "primitives", "mib": mib, "stages": stages.rows}


def startup(name: str, width: int, layers: int, steps: int) -> dict[str, Any]:
    stages = Stages()
    shape = capacity_chip.shape_of(width, layers, 1024, 4)
    begin, grad_step = capacity_chip.trainer(shape, name)
    made = make.route(begin, (jax.random.key(0),), {})
    leaves = list(made.leaves)
    zero = jnp.int32(0)
    buffers: list[Any] = []
    for program in made.programs:
        if program.kind == "buffers":
            buffers = program.fun(zero, made.dynamic)
            stages(program.what, [x for x in leaves if isinstance(x, jax.Array)] + buffers)
            continue
        if program.kind == "whole":
            outs = program.fun(zero, made.dynamic)
        else:
            for i in range(program.layers):
                buffers = program.fun(buffers, jnp.int32(i), made.dynamic)
            outs, buffers = buffers, []
        for i, x in zip(program.indices, outs, strict=True):
            leaves[i] = x
        stages(program.what, [x for x in leaves if isinstance(x, jax.Array)])
    model, state = jax.tree.unflatten(
        jax.tree.structure(made.abstract, is_leaf=make.is_abstract), leaves)
    step = eqx_offload.filter_jit(donate=("model", "state"))(
        lambda model, state, tokens: grad_step(model, state, tokens, None))
    tokens = jax.random.randint(jax.random.key(1), (4, 1025), 0, shape.vocab)
    for n in range(steps):
        model, state, loss = step(model, state, tokens)
        stages(f"step {n + 1} (loss {float(loss):.3f})", (model, state))
    return {"run": "startup", "mode": name, "shape": shape.name, "params": shape.params,
            "stages": stages.rows}


if __name__ == "__main__":
    args = sys.argv[1:]
    try:
        if args[0] == "primitives":
            result = primitives(int(args[1]))
        else:
            result = startup(args[1], int(args[2]), int(args[3]),
                             int(args[4]) if len(args) > 4 else 2)
    except Exception as error:  # noqa: BLE001 - reported as JSON
        result = {"run": " ".join(args), "error": f"{type(error).__name__}: {str(error)[:600]}"}
    capacity_chip.emit(result, "host_rss.jsonl")

"""How fast can a process put arrays into `pinned_host` at start-up? One route per process
(the host allocator's state must not carry over between routes), JAX and NumPy only:

    python bench/results/tpu-v5e-2026-12-06/startup_probe.py ROUTE [MIB] [COUNT]

Routes:
- `fresh`: COUNT arrays of MIB MiB made by a jit whose `out_shardings` are in
  `pinned_host` (zeros), each kept alive: the cost of new pinned memory.
- `reuse`: one such array made, deleted, then made again COUNT times: whether the
  allocator hands freed pinned memory back.
- `donate`: one array made, then rewritten COUNT times by a jit that donates it (the
  way a training step writes its state back).
- `device_put`: a device array copied to `pinned_host` COUNT times (each kept).
- `unpinned`: as `fresh` in `unpinned_host`, then each array copied to the device.
- `chunks`: COUNT * 16 arrays of MIB / 16 MiB each (many small leaves).
- `threads`: COUNT arrays as `fresh`, each made by a thread of its own, all at once
  (whether new pinned memory fills faster in parallel).
- `numpy`: COUNT NumPy arrays of MIB MiB filled in ordinary memory: the kernel's own
  rate for new pages, the floor under every route.

Each prints one JSON line (appended to $OUT/startup.jsonl when OUT is set): the seconds
of each array, GB/s, the process's resident memory and the host's available memory
before JAX starts, after it starts and at the end (the runtime's own share).
"""

import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import harness  # (bench/)


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":")
            if key in ("MemAvailable", "MemFree"):
                out[key] = int(value.split()[0]) * 1024
    return {**out, "VmRSS": harness.resident()}


def sharding(kind: str) -> jax.sharding.Sharding:
    return jax.sharding.make_single_device_sharding(jax.devices()[0], memory_kind=kind)


def timed(fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def main(route: str, mib: int, count: int) -> dict:
    before = meminfo()
    dev = jax.devices()[0]
    started = meminfo()
    n = mib * 2**20 // 4
    record = {"route": route, "mib": mib, "count": count, "device": str(dev),
              "env": {k: v for k, v in os.environ.items() if k.startswith(("TPU_", "XLA_"))},
              "mem_before_jax": before, "mem_after_jax": started}
    host = sharding("pinned_host")
    make = jax.jit(lambda i: jnp.full((n,), i, jnp.float32), out_shardings=host)
    make(jnp.float32(-1)).block_until_ready()  # compile (and one small warm-up)
    times, keep = [], []
    if route in ("fresh", "reuse"):
        for i in range(count):
            out, t = timed(make, jnp.float32(i))
            times.append(t)
            if route == "fresh":
                keep.append(out)
            else:
                out.delete()
    elif route == "donate":
        write = jax.jit(lambda a, i: a * 0 + i, out_shardings=host, donate_argnums=0)
        a, t = timed(make, jnp.float32(0))
        times.append(t)
        for i in range(count):
            a, t = timed(write, a, jnp.float32(i))
            times.append(t)
    elif route == "device_put":
        on_dev = jnp.ones((n,), jnp.float32).block_until_ready()
        for _ in range(count):
            out, t = timed(lambda x: jax.device_put(x, host), on_dev)
            times.append(t)
            keep.append(out)
    elif route == "unpinned":
        unpinned = jax.jit(lambda i: jnp.full((n,), i, jnp.float32),
                           out_shardings=sharding("unpinned_host"))
        to_dev = []
        for i in range(count):
            out, t = timed(unpinned, jnp.float32(i))
            times.append(t)
            d, t2 = timed(lambda x: jax.device_put(x, sharding("device")), out)
            to_dev.append(t2)
            keep.append(out)
            d.delete()
        record["to_device_s"] = to_dev
        record["to_device_gbps"] = [mib * 2**20 / t / 1e9 for t in to_dev]
    elif route == "chunks":
        small = jax.jit(lambda i: jnp.full((n // 16,), i, jnp.float32), out_shardings=host)
        small(jnp.float32(-1)).block_until_ready()
        for i in range(count):
            start = time.perf_counter()
            outs = [small(jnp.float32(j)) for j in range(16)]
            jax.block_until_ready(outs)
            times.append(time.perf_counter() - start)
            keep.extend(outs)
    elif route == "threads":
        import concurrent.futures
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            keep = list(pool.map(lambda i: make(jnp.float32(i)).block_until_ready(),
                                 range(count)))
        times.append((time.perf_counter() - start) / count)  # per array, all at once
    elif route == "numpy":
        import numpy as np
        for i in range(count):
            start = time.perf_counter()
            keep.append(np.full((n,), i, np.float32))
            times.append(time.perf_counter() - start)
    else:
        raise SystemExit(f"unknown route {route}")
    record["seconds"] = times
    record["gbps"] = [mib * 2**20 / t / 1e9 for t in times]
    record["mem_end"] = meminfo()
    return harness.record(**record)


if __name__ == "__main__":
    args = sys.argv[1:]
    mib, count = (int(a) for a in (args[1:] + ["1024", "3"][len(args) - 1:])[:2])
    harness.run_row("startup", {"route": args[0]}, lambda: main(args[0], mib, count))

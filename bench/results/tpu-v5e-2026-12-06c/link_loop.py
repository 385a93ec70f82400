"""The host link inside a loop, as the streamed update and the layer scan run it.

A `lax.scan` of L iterations; each iteration brings K slices of K stacked host arrays to
the device (one copy each per iteration), computes on them, and writes K slices back into
K donated stacked host arrays (one copy each the other way). Directions: `h2d` (fetch
only), `d2h` (write only), `both`. Prints one JSON line per variant: the median time,
GB/s per direction, and both / max(h2d, d2h) (1.0: the directions overlap fully; 2.0:
one after the other).

  python link_loop.py MIB_PER_COPY K L [UNROLL] [VARIANT]

VARIANT: `dep` (default: iteration i writes what it computed from its fetch), `indep`
(the write does not depend on the fetch), `pipe` (software-pipelined: iteration i fetches
slice i + 1 into the carry while it computes and writes slice i).
"""
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mib, K, L = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
unroll = int(sys.argv[4]) if len(sys.argv) > 4 else 1
variant = sys.argv[5] if len(sys.argv) > 5 else "dep"
dev = jax.devices()[0]
mesh = Mesh(np.array([dev]), ("x",))
D = NamedSharding(mesh, P(), memory_kind="device")
H = NamedSharding(mesh, P(), memory_kind="pinned_host")
rows = max(1, mib * 1024 * 1024 // 4 // 1024)
shape = (L, rows, 1024)
nbytes = L * K * rows * 1024 * 4  # each direction


def make(val, sh):
    return [jax.jit(lambda: jnp.full(shape, val, jnp.float32), out_shardings=sh)() for _ in range(K)]


def sl(a, i):
    return jax.lax.dynamic_slice(a, (i, 0, 0), (1,) + shape[1:])


def up(a, i, p):
    return jax.lax.dynamic_update_slice(a, p, (i, 0, 0))


def program(direction):
    fetch_on = direction in ("h2d", "both")
    write_on = direction in ("d2h", "both")

    def fetch(xs, i):
        return [jax.device_put(sl(x, i), jax.memory.Space.Device) for x in xs]

    def f(xs, hs):
        def body(carry, i):
            outs, acc, ahead = carry
            if fetch_on:
                if variant == "pipe":
                    fetched, ahead = ahead, fetch(xs, jnp.minimum(i + 1, L - 1))
                else:
                    fetched = fetch(xs, i)
                acc = acc + sum(jnp.sum(p) for p in fetched)
            if write_on:
                scale = (carry[1] if variant == "indep" else acc) + i.astype(jnp.float32)
                pieces = [jnp.full((1,) + shape[1:], 2.0, jnp.float32) * scale for _ in range(K)]
                outs = [up(o, i, jax.device_put(p, jax.memory.Space.Host)) for o, p in zip(outs, pieces)]
            return (outs, acc, ahead), None

        ahead = fetch(xs, 0) if (variant == "pipe" and fetch_on) else []
        (outs, acc, _), _ = jax.lax.scan(body, (hs, jnp.float32(0), ahead), jnp.arange(L), unroll=unroll)
        return outs, acc

    return jax.jit(f, in_shardings=([H] * K, [H] * K), out_shardings=([H] * K, D),
                   donate_argnums=1, keep_unused=True)

if __name__ == "__main__":
    xs = make(1.0, H)
    hs = make(0.0, H)
    res = {"mib_per_copy": mib, "copies_each_way_per_iter": K, "iters": L, "unroll": unroll, "variant": variant,
           "platform": dev.platform, "bytes_each_way": nbytes}
    for direction in ("h2d", "d2h", "both"):
        f = program(direction)
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            hs, acc = f(xs, hs)
            jax.block_until_ready((hs, acc))
            ts.append(time.perf_counter() - t)
        med = statistics.median(ts[1:])
        res[direction + "_ms"] = round(med * 1e3, 2)
        res[direction + "_GBps"] = round(nbytes / med / 1e9, 2)
    res["both_over_max"] = round(res["both_ms"] / max(res["h2d_ms"], res["d2h_ms"]), 3)
    res["both_over_sum"] = round(res["both_ms"] / (res["h2d_ms"] + res["d2h_ms"]), 3)
    print(json.dumps(res), flush=True)

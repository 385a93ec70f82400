"""Both copy directions in a loop, as the streamed update runs: how many copies in flight
each way keep the host link busy both ways at once?

`../shared/tpu-results/2026-12-06b/duplex.py` timed one program that copies all its bytes
at once: up to 4 copies each way, both directions ran together (1.10x one direction);
from 8 they serialised. The streamed update is a loop instead: each step of it brings one
group in and sends one group back. This probe times, over preallocated arrays (host
outputs written in place into donated host buffers):

  h2d     one copy of `copy_mib` to the device per copy slot and iteration (into a
          device accumulator)
  d2h     one copy of `copy_mib` to host per slot and iteration (`y * 2`, written into
          the donated host buffer's rows)
  both    the two in one loop, independent (duplex.py's `both`, one iteration at a time)
  update  the streamed update's own pattern: each iteration reads its rows of a host
          buffer, computes `x * a + b` on the device and writes them back in place (so
          the copy out depends on the copy in; overlap comes from other iterations)

with `per_iter` copies each way per iteration (1, 2, 4: a group's leaves), in three forms:

  fori      `lax.fori_loop` over the iterations (one trip's copies in flight at most,
            unless XLA pipelines the loop)
  fenced    the iterations unrolled, iteration i's inputs held by an
            `optimization_barrier` until iteration i - 2's outputs are on host (the
            streamed update's default, `lookahead=1`: at most about 2 trips in flight)
  unrolled  the iterations unrolled, no fence (XLA's scheduler decides)

Prints one JSON line per (form, copy_mib, per_iter): each program's median time, GB/s,
`both / max(h2d, d2h)` (1.0: full duplex; 2.0: one direction at a time), and for each
program the largest number of copies each way in flight at once in the compiled
schedule of its entry computation and loop bodies (`in_flight`). Stops starting new
rows after `--budget-s`.

    python bench/results/tpu-v5e-2026-12-06c/duplex_loop.py                          # on the chip, <= 2 min
    python bench/results/tpu-v5e-2026-12-06c/duplex_loop.py --copy-mib 64 --per-iter 1 --forms fori
    JAX_PLATFORMS=cpu python bench/results/tpu-v5e-2026-12-06c/duplex_loop.py --total-mib 1 --copy-mib 0.25 \
        --per-iter 1,2 --reps 2                              # the CPU, a smoke run
    JAX_PLATFORMS=cpu TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_WORKER_HOSTNAMES=localhost \
        TPU_SKIP_MDS_QUERY=1 python bench/results/tpu-v5e-2026-12-06c/duplex_loop.py --compile-only  # no chip
"""

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


DEVICE = jax.memory.Space.Device
HOST = jax.memory.Space.Host
_START = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<type>.*?)\s"
                    r"(?P<op>[a-z][a-z0-9\-]*-start)\(")
_DONE = re.compile(r"^\s*(?:ROOT\s+)?%[^\s=]+\s*=.*?\s[a-z][a-z0-9\-]*-done\(\s*%?(?P<arg>[^\s,)]+)")
_ARRAY = re.compile(r"[a-z]+[0-9]*\[[0-9,]*\](?:\{(?P<layout>[^}]*)\})?")


def in_flight(hlo_text: str) -> dict[str, int]:
    """The largest number of host<->device copies each way started and not yet done at
    one point of any computation's schedule (the entry's or a loop body's), from the
    scheduled HLO: a `*-start` whose operand or result is in host memory (`S(5)`)."""
    most = {"to_device": 0, "to_host": 0}
    for block in re.split(r"\n(?=\S)", hlo_text):
        open_: dict[str, str] = {}
        for line in block.splitlines():
            m = _START.match(line)
            if m is not None:
                host = ["S(5)" in (a.group("layout") or "") for a in _ARRAY.finditer(m.group("type"))]
                if any(host) and len(host) >= 2:
                    # (types: (operands..., result, context...)); the result on host: to host
                    to_host = host[-2] if len(host) >= 3 else host[-1]
                    open_[m.group("name")] = "to_host" if to_host else "to_device"
                    direction = open_[m.group("name")]
                    most[direction] = max(most[direction],
                                          sum(d == direction for d in open_.values()))
                continue
            d = _DONE.match(line)
            if d is not None:
                open_.pop(d.group("arg"), None)
    return most


def programs(form: str, n: int, k: int) -> dict[str, Callable[..., Any]]:
    """The four programs of one form over `n` iterations of `k` copies each way; arrays
    are `(n * k, rows, 1024)` float32 (iteration i's copy c is row i * k + c): `xs` on host, `ys` on the device, `hs` on host
    (donated)."""

    def h2d_step(i: Any, xs: Any, acc: list[Any]) -> list[Any]:
        return [a + jax.device_put(xs[i * k + c], DEVICE) for c, a in enumerate(acc)]

    def d2h_step(i: Any, ys: Any, hs: Any) -> Any:
        for c in range(k):
            row = jax.device_put(ys[i * k + c] * 2.0, HOST)
            hs = jax.lax.dynamic_update_slice_in_dim(hs, row[None], i * k + c, axis=0)
        return hs

    def update_step(i: Any, xs: Any) -> Any:
        for c in range(k):
            x = jax.device_put(xs[i * k + c], DEVICE)
            row = jax.device_put(x * 0.5 + 1.0, HOST)
            xs = jax.lax.dynamic_update_slice_in_dim(xs, row[None], i * k + c, axis=0)
        return xs

    def zeros(like: Any) -> list[Any]:
        return [jnp.zeros(like.shape[1:], like.dtype) for _ in range(k)]

    if form == "fori":
        def h2d(xs: Any) -> Any:
            return jax.lax.fori_loop(0, n, lambda i, acc: h2d_step(i, xs, acc), zeros(xs))

        def d2h(ys: Any, hs: Any) -> Any:
            return jax.lax.fori_loop(0, n, lambda i, hs: d2h_step(i, ys, hs), hs)

        def both(xs: Any, ys: Any, hs: Any) -> Any:
            return jax.lax.fori_loop(
                0, n, lambda i, c: (h2d_step(i, xs, c[0]), d2h_step(i, ys, c[1])),
                (zeros(xs), hs))

        def update(xs: Any) -> Any:
            return jax.lax.fori_loop(0, n, update_step, xs)

    else:
        fenced = form == "fenced"

        def fence(i: int, waits: list[Any], x: Any) -> Any:
            # iteration i's input waits for iteration i - 2's output (lookahead=1)
            if not fenced or i < 2:
                return x
            _, x = jax.lax.optimization_barrier((waits[i - 2], x))
            return x

        def h2d(xs: Any) -> Any:
            acc, outs = zeros(xs), []
            for i in range(n):
                acc = h2d_step(i, fence(i, outs, xs), acc)
                outs.append(acc)
            return acc

        def d2h(ys: Any, hs: Any) -> Any:
            outs: list[Any] = []
            for i in range(n):
                hs = d2h_step(i, fence(i, outs, ys), hs)
                outs.append(hs)
            return hs

        def both(xs: Any, ys: Any, hs: Any) -> Any:
            acc, outs = zeros(xs), []
            for i in range(n):
                xs_i, ys_i = fence(i, outs, (xs, ys))
                acc = h2d_step(i, xs_i, acc)
                hs = d2h_step(i, ys_i, hs)
                outs.append(hs)
            return acc, hs

        def update(xs: Any) -> Any:
            outs: list[Any] = []
            for i in range(n):
                xs = update_step(i, fence(i, outs, xs))
                outs.append(xs)
            return xs

    return {"h2d": h2d, "d2h": d2h, "both": both, "update": update}


def compiled(form: str, n: int, k: int, shape: tuple[int, ...], device: Any) -> dict[str, Any]:
    """The four programs jitted with the arrays' shardings on `device`, and compiled."""
    mesh = Mesh(np.array([device]), ("x",))
    D = NamedSharding(mesh, P(), memory_kind="device")
    H = NamedSharding(mesh, P(), memory_kind="pinned_host")
    f = programs(form, n, k)
    host = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=H)
    dev = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=D)
    jitted = {
        "h2d": jax.jit(f["h2d"], out_shardings=[D] * k).lower(host),
        "d2h": jax.jit(f["d2h"], out_shardings=H, donate_argnums=1).lower(dev, host),
        "both": jax.jit(f["both"], out_shardings=([D] * k, H), donate_argnums=2,
                        keep_unused=True).lower(host, dev, host),
        "update": jax.jit(f["update"], out_shardings=H, donate_argnums=0).lower(host),
    }
    return {name: lowered.compile() for name, lowered in jitted.items()}


def median_ms(fn: Callable[[], None], reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts[1:] if reps > 1 else ts)


def sizes(copy_mib: float, k: int, total_mib: float) -> tuple[int, int, tuple[int, ...]]:
    """The bytes of one copy, the iterations, and the arrays' shape."""
    rows = max(1, int(copy_mib * (1 << 20)) // 4 // 1024)
    copy_bytes = rows * 1024 * 4
    n = max(1, int(total_mib * (1 << 20)) // (copy_bytes * k))
    # (one leading axis of n * k copies: XLA:TPU slices host memory asynchronously in
    # one dimension only, "Async slice only supports slicing in 1 dimension")
    return copy_bytes, n, (n * k, rows, 1024)


def planned(form: str, copy_mib: float, k: int, total_mib: float, device: Any) -> dict[str, Any]:
    """The copies in flight of each program as XLA schedules it for `device`."""
    copy_bytes, n, shape = sizes(copy_mib, k, total_mib)
    programs_ = compiled(form, n, k, shape, device)
    return {"form": form, "copy_mib": round(copy_bytes / (1 << 20), 3), "per_iter": k,
            "iterations": n,
            "in_flight": {name: in_flight(c.as_text()) for name, c in programs_.items()}}


def row(form: str, copy_mib: float, k: int, total_mib: float, reps: int,
        device: Any) -> dict[str, Any]:
    copy_bytes, n, shape = sizes(copy_mib, k, total_mib)
    nbytes = n * k * copy_bytes
    programs_ = compiled(form, n, k, shape, device)
    mesh = Mesh(np.array([device]), ("x",))
    D = NamedSharding(mesh, P(), memory_kind="device")
    H = NamedSharding(mesh, P(), memory_kind="pinned_host")

    def full(value: float, sharding: Any) -> Any:
        return jax.jit(lambda: jnp.full(shape, value, jnp.float32), out_shardings=sharding)()

    xs, ys = full(1.0, H), full(2.0, D)
    state = {"hs": full(0.0, H), "us": full(1.0, H)}

    def run_h2d() -> None:
        jax.block_until_ready(programs_["h2d"](xs))

    def run_d2h() -> None:
        state["hs"] = jax.block_until_ready(programs_["d2h"](ys, state["hs"]))

    def run_both() -> None:
        acc, state["hs"] = jax.block_until_ready(programs_["both"](xs, ys, state["hs"]))

    def run_update() -> None:
        state["us"] = jax.block_until_ready(programs_["update"](state["us"]))

    out: dict[str, Any] = {"form": form, "copy_mib": round(copy_bytes / (1 << 20), 3),
                           "per_iter": k, "iterations": n,
                           "mib_each_way": round(nbytes / (1 << 20), 3)}
    for name, fn in (("h2d", run_h2d), ("d2h", run_d2h), ("both", run_both),
                     ("update", run_update)):
        ms = median_ms(fn, reps)
        out[name + "_ms"] = round(ms, 3)
        out[name + "_GBps"] = round((1 if name in ("h2d", "d2h") else 2) * nbytes / ms / 1e6, 2)
    hs = np.asarray(jax.device_get(state["hs"]))[:, -1, -1]  # (each copy's last: 2 * 2.0)
    out["written"] = bool((hs == 4.0).all())
    one_way = max(out["h2d_ms"], out["d2h_ms"])
    out["both_over_max"] = round(out["both_ms"] / one_way, 3)
    out["update_over_max"] = round(out["update_ms"] / one_way, 3)
    out["in_flight"] = {name: in_flight(c.as_text()) for name, c in programs_.items()}
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    floats = lambda s: [float(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--forms", default="fori,fenced,unrolled")
    parser.add_argument("--copy-mib", type=floats, default=[4, 16, 64, 256])
    parser.add_argument("--per-iter", type=lambda s: [int(v) for v in s.split(",")],
                        default=[1, 2, 4])
    parser.add_argument("--total-mib", type=float, default=512,
                        help="bytes each way per program (rounded down to whole iterations)")
    parser.add_argument("--reps", type=int, default=4, help="calls per program (first one not timed)")
    parser.add_argument("--budget-s", type=float, default=110,
                        help="start no new row after this many seconds")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for a TPU v5e through libtpu (no chip) and print the "
                             "copies in flight of each program's schedule, without timing")
    args = parser.parse_args(argv)
    if args.compile_only:
        from jax.experimental import topologies
        device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    else:
        device = jax.devices()[0]
    start = time.perf_counter()
    print(json.dumps({"probe": "duplex_loop", "jax": jax.__version__,
                      "device": str(device.device_kind), "platform": device.platform}),
          flush=True)
    for form in args.forms.split(","):
        for copy_mib in args.copy_mib:
            for k in args.per_iter:
                if time.perf_counter() - start > args.budget_s:
                    print(json.dumps({"skipped": [form, copy_mib, k], "reason": "budget"}),
                          flush=True)
                    continue
                if copy_mib * k > args.total_mib:
                    continue
                t = time.perf_counter()
                if args.compile_only:
                    print("PLANNED " + json.dumps(planned(form, copy_mib, k, args.total_mib, device)),
                          flush=True)
                    continue
                result = row(form, copy_mib, k, args.total_mib, args.reps, device)
                result["seconds"] = round(time.perf_counter() - t, 1)
                print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

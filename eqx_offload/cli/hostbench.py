"""`python -m eqx_offload bench-host`: the host side of `offloaded(..., compute="host")`.

In one run on this machine, for AdamW at a list of sizes: the update as eqx_offload runs
it on the CPU backend, plain `jax.jit(optax.adamw(...).update)`, a hand-fused update
(one elementwise expression per leaf), torch's CPU AdamW (when torch is importable) and a
NumPy copy; then the Modes page's condition for host compute, `H > 3.5 L`, evaluated
with the measured `H`. Throughput is GB/s of state touched: 28 bytes a parameter
(fp32 parameters, gradients, `mu`, `nu` read; parameters, `mu`, `nu` written)."""

import argparse
import gc
import importlib
import json
import os
import textwrap
import time
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_offload

from .measure import bitwise_equal, load_average, machine_info, summary


BYTES_PER_PARAMETER = 28
COUNTING = ("fp32 AdamW, per parameter: params, grads, mu, nu read (16 B); params, mu, nu "
            "written (12 B): 28 B, the least any implementation must move")
LEAF_SIDE = 4096
LINKS = {"PCIe 4.0 x16": 25.0, "PCIe 5.0 x16": 50.0, "H200 link, measured": 54.0}
"""Link bandwidths (GB/s, one direction) the Modes page uses."""
LR, WEIGHT_DECAY = 1e-3, 1e-4
GB = 1e9
IMPLEMENTATIONS = ("eqx_offload", "optax_jit", "hand_fused", "torch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e8, 3e8, 1e9],
                        help="parameter counts (default 1e8 3e8 1e9; sizes that do not fit "
                             "in available memory are skipped)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed steps per implementation and size (default 7)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (1e5, 1e6) and 3 repeats: a few seconds")
    parser.add_argument("--no-torch", action="store_true", help="skip torch even if installed")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")


# --------------------------------------------------------------------------- timing

def _time(step: Callable[[], None], repeats: int) -> dict[str, Any]:
    """Wall and process-CPU seconds of `repeats` calls of `step` (after one warm-up)."""
    step()
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(repeats):
        c, t = time.process_time(), time.perf_counter()
        step()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return {"wall": summary(wall), "cpu": summary(cpu)}


def _rates(timing: dict[str, Any], nbytes: int) -> dict[str, Any]:
    wall, cpu = timing["wall"], timing["cpu"]
    return {
        **timing,
        "gbps": nbytes / wall["median"] / GB,
        "gbps_range": [nbytes / wall["max"] / GB, nbytes / wall["min"] / GB],
        "gb_per_cpu_second": nbytes / max(cpu["median"], 1e-9) / GB,
        "cpu_per_wall": cpu["median"] / wall["median"],
    }


# --------------------------------------------------------------------------- workloads

def _shapes(n: int) -> list[tuple[int, ...]]:
    """`n` parameters as 4096 x 4096 leaves (64 MiB each) and one leaf for the rest."""
    full, rest = divmod(n, LEAF_SIDE * LEAF_SIDE)
    shapes: list[tuple[int, ...]] = [(LEAF_SIDE, LEAF_SIDE)] * full
    return shapes + [(rest,)] if rest else shapes


def _tree(shapes: list[tuple[int, ...]], value: float) -> dict[str, jax.Array]:
    return {f"w{i:04d}": jnp.full(s, value, jnp.float32) for i, s in enumerate(shapes)}


def _optax_step(optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    def step(grads: Any, params: Any, state: Any) -> tuple[Any, Any]:
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


def _hand_fused(grads: Any, params: Any, state: Any) -> tuple[Any, Any]:
    """AdamW as optax writes it, one elementwise expression per leaf."""
    mu, nu, count = state
    count = count + 1
    b1, b2, eps = 0.9, 0.999, 1e-8
    c1 = 1 - b1 ** count.astype(jnp.float32)
    c2 = 1 - b2 ** count.astype(jnp.float32)

    def leaf(g: jax.Array, p: jax.Array, m: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / c1) / (jnp.sqrt(v / c2) + eps) + WEIGHT_DECAY * p
        return p + (-LR) * u, m, v

    out = {k: leaf(grads[k], params[k], mu[k], nu[k]) for k in params}
    return ({k: o[0] for k, o in out.items()},
            ({k: o[1] for k, o in out.items()}, {k: o[2] for k, o in out.items()}, count))


def _jax_runner(name: str, shapes: list[tuple[int, ...]], grads: Any) -> tuple[Any, Any]:
    """(`step() -> None`, the compiled executable) of one JAX implementation; the state
    it updates in place (donated) lives in the closure."""
    params = _tree(shapes, 0.5)
    adamw = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    if name == "eqx_offload":
        opt = eqx_offload.offloaded(adamw, compute="host")
        fn: Any = eqx_offload.filter_jit(_optax_step(opt), donate=("params", "state"))
        state: Any = opt.init(params)
    elif name == "optax_jit":
        fn, state = jax.jit(_optax_step(adamw), donate_argnums=(1, 2)), adamw.init(params)
    else:
        fn = jax.jit(_hand_fused, donate_argnums=(1, 2))
        state = (_tree(shapes, 0.0), _tree(shapes, 0.0), jnp.zeros([], jnp.int32))
    compiled = fn.lower(grads, params, state).compile()
    box = [params, state]

    def step() -> None:
        box[0], box[1] = fn(grads, box[0], box[1])
        jax.block_until_ready(box)
    return step, compiled


def _hlo_facts(compiled: Any, n_leaves: int) -> dict[str, Any]:
    """What XLA made of the update: passes over the state (loop fusions with an array
    output, per leaf), XLA's estimate of the bytes it touches, the parallel split."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY"):]
    big = [line for line in entry.splitlines()  # an f32 array output, not a scalar
           if " fusion(" in line and "f32[" in line and "f32[]" not in line.split("fusion(")[0]]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    split = sorted({line.split('"outer_dimension_partitions":[')[1].split("]")[0].strip('"')
                    for line in big if "outer_dimension_partitions" in line})
    return {"passes_per_leaf": len(big) / max(n_leaves, 1),
            "bytes_accessed": float((cost or {}).get("bytes accessed", 0.0)),
            "outer_dimension_partitions": split}


def _torch_runner(torch: Any, shapes: list[tuple[int, ...]]) -> tuple[Callable[[], None], str]:
    params = [torch.full(s, 0.5, requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.full(p.shape, 0.01)
    try:
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        opt.step()
        variant = "fused=True"
    except (RuntimeError, TypeError):  # a torch without fused CPU AdamW
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
        opt.step()
        variant = "foreach=True"
    return opt.step, variant


def _import_torch(skip: bool) -> Optional[Any]:
    if skip:
        return None
    try:  # torch is not a dependency: imported by name, not typed
        torch = importlib.import_module("torch")
    except ImportError:
        print("torch is not installed: no torch column (pip install torch)")
        return None
    return torch


def _available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _copy(n: int, repeats: int) -> dict[str, Any]:
    """A NumPy copy of `n` float32 (read + write counted)."""
    src = np.full(n, 0.5, np.float32)
    dst = np.empty_like(src)
    out = _rates(_time(lambda: np.copyto(dst, src), repeats), 2 * src.nbytes)
    out["bytes"] = 2 * src.nbytes
    return out


# --------------------------------------------------------------------------- one size

def _measure_size(n: int, repeats: int, torch: Optional[Any]) -> dict[str, Any]:
    nbytes = BYTES_PER_PARAMETER * n
    need = 20 * n + (1 << 28)  # params, mu, nu, grads (16 B) and a margin
    free = _available_bytes()
    row: dict[str, Any] = {"parameters": n, "bytes_touched": nbytes,
                           "available_bytes": free, "results": {}, "hlo": {}}
    if free is not None and need > free:
        row["skipped"] = f"needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
        return row
    shapes = _shapes(n)
    row["leaves"] = len(shapes)
    grads = _tree(shapes, 0.01)
    for name in IMPLEMENTATIONS[:3]:
        step, compiled = _jax_runner(name, shapes, grads)
        row["results"][name] = _rates(_time(step, repeats), nbytes)
        row["hlo"][name] = _hlo_facts(compiled, len(shapes))
        del step, compiled
        gc.collect()
    del grads
    gc.collect()
    if torch is not None:
        step, variant = _torch_runner(torch, shapes)
        row["results"]["torch"] = {**_rates(_time(step, repeats), nbytes), "variant": variant}
        del step
        gc.collect()
    row["copy"] = _copy(n, repeats)
    return row


def _hand_fused_matches(n: int = 1 << 16) -> bool:
    """Whether the hand-fused update gives optax's bits after three steps (CPU)."""
    shapes = _shapes(n)
    grads = _tree(shapes, 0.01)
    adamw = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    a = (_tree(shapes, 0.5), adamw.init(_tree(shapes, 0.5)))
    b = (_tree(shapes, 0.5), (_tree(shapes, 0.0), _tree(shapes, 0.0), jnp.zeros([], jnp.int32)))
    plain, fused = jax.jit(_optax_step(adamw)), jax.jit(_hand_fused)
    for _ in range(3):
        a, b = plain(grads, *a), fused(grads, *b)
    return bitwise_equal(a[0], b[0])


# --------------------------------------------------------------------------- the condition

def _condition(host_gbps: float) -> list[dict[str, Any]]:
    """The Modes page's condition per link: host compute moves 8 B a parameter over the
    link and touches 28 B on the host; the device modes move 16 B over the link."""
    rows = []
    for link, L in LINKS.items():
        device_s = 16 / L
        host_s = BYTES_PER_PARAMETER / host_gbps + 8 / L
        rows.append({"link": link, "L_gbps": L, "H_gbps": host_gbps,
                     "H_needed_fp32": 3.5 * L, "H_needed_bf16": 22 / 12 * L,
                     "wins_fp32": host_gbps > 3.5 * L, "wins_bf16": host_gbps > 22 / 12 * L,
                     "host_over_device_time_fp32": host_s / device_s})
    return rows


def _threads() -> dict[str, Any]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cpu_count": os.cpu_count(), "affinity": affinity,
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "load_average": load_average()}


# --------------------------------------------------------------------------- report

def _table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'params':>7} {'implementation':<22} {'median ms':>10} {'min-max ms':>17} "
             f"{'GB/s':>6} {'GB/CPU-s':>9} {'CPU/wall':>8}"]
    for row in rows:
        label = f"{row['parameters'] / 1e6:.0f}M" if row["parameters"] >= 1e6 \
            else f"{row['parameters'] / 1e3:.0f}k"
        if "skipped" in row:
            lines.append(f"{label:>7} skipped: {row['skipped']}")
            continue
        results = dict(row["results"], numpy_copy=row["copy"])
        for name, r in results.items():
            shown = f"torch AdamW {r['variant']}" if name == "torch" else name
            w = r["wall"]
            lines.append(
                f"{label:>7} {shown:<22} {w['median'] * 1e3:>10.1f} "
                f"{w['min'] * 1e3:>8.1f}-{w['max'] * 1e3:<8.1f} {r['gbps']:>6.1f} "
                f"{r['gb_per_cpu_second']:>9.1f} {r['cpu_per_wall']:>8.2f}")
    return lines


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios at the largest measured size, and the condition with its `H`."""
    measured = [r for r in rows if "skipped" not in r]
    if not measured:
        return {}
    top = measured[-1]
    h = top["results"]["eqx_offload"]["gbps"]
    out: dict[str, Any] = {"parameters": top["parameters"], "H_gbps": h,
                           "copy_over_H": top["copy"]["gbps"] / h, "condition": _condition(h)}
    if "torch" in top["results"]:
        out["torch_over_H"] = top["results"]["torch"]["gbps"] / h
    out["xla"] = {**top["hlo"]["eqx_offload"], "bytes_per_parameter":
                  top["hlo"]["eqx_offload"]["bytes_accessed"] / top["parameters"]}
    return out


def _print_summary(s: dict[str, Any]) -> None:
    if not s:
        print("nothing measured (every size skipped)")
        return
    print(f"\nAt {s['parameters'] / 1e6:.0f}M parameters: H = {s['H_gbps']:.1f} GB/s "
          f"(eqx_offload's host update); copy/H = {s['copy_over_H']:.2f}"
          + (f", torch/H = {s['torch_over_H']:.2f}" if "torch_over_H" in s else ""))
    xla = s["xla"]
    print(f"XLA: {xla['passes_per_leaf']:.0f} loops a leaf, {xla['bytes_per_parameter']:.0f} B "
          f"a parameter (its estimate; one pass: {BYTES_PER_PARAMETER}), each loop in "
          f"{'/'.join(xla['outer_dimension_partitions']) or '1'} parallel parts")
    print(f"{'link':<22} {'L GB/s':>7} {'fp32 needs H >':>15} {'wins':>5} "
          f"{'bf16 needs H >':>15} {'wins':>5} {'host/device time':>17}")
    for c in s["condition"]:
        print(f"{c['link']:<22} {c['L_gbps']:>7.0f} {c['H_needed_fp32']:>15.1f} "
              f"{'yes' if c['wins_fp32'] else 'no':>5} {c['H_needed_bf16']:>15.1f} "
              f"{'yes' if c['wins_bf16'] else 'no':>5} {c['host_over_device_time_fp32']:>17.2f}")


def run(args: argparse.Namespace) -> int:
    sizes = [100_000, 1_000_000] if args.quick else [int(s) for s in args.sizes]
    repeats = 3 if args.quick else args.repeats
    torch = _import_torch(args.no_torch)
    info = {**machine_info(), **_threads(), "bytes_per_parameter": BYTES_PER_PARAMETER,
            "counting": COUNTING, "repeats": repeats,
            "torch_version": getattr(torch, "__version__", None),
            "torch_threads": torch.get_num_threads() if torch is not None else None}
    print(textwrap.fill(
        f"{info['cpu']}, {info['cpu_count']} cores ({info['affinity']} usable), load "
        f"{info['load_average']}; jax {info['jax_version']}, numpy {info['numpy_version']}, "
        f"torch {info['torch_version']}", 100))
    print(textwrap.fill(COUNTING, 100))
    rows = []
    for n in sizes:
        rows.append(_measure_size(n, repeats, torch))
        print("\n".join(_table(rows[-1:])[(0 if len(rows) == 1 else 1):]), flush=True)
    result: dict[str, Any] = {
        "machine": info, "sizes": rows, "summary": _summary(rows),
        "hand_fused_bitwise_equal_to_optax": _hand_fused_matches()}
    _print_summary(result["summary"])
    print(f"hand-fused update bitwise equal to optax.adamw: "
          f"{result['hand_fused_bitwise_equal_to_optax']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0

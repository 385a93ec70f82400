"""`python -m eqx_offload plan --capacity`: the command line of the capacity planner
(`capacity`, `capacity_batch`), its table and its `--quick` ladder."""

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any, Optional

import jax
import numpy as np

import eqx_offload

from .capacity import (Capacity, CAPACITY_MODES, CapacityMode, CapacityPoint, GB, MODES_BY_NAME,
                       over_limits, PointCache, capacity, point_from_record, point_record,
                       settings_text, size_text, write_outputs)
from .llama import LlamaShape


def _ms(seconds: float) -> str:
    """Milliseconds, whole above one (a small model's floors would read 0)."""
    return f"{seconds * 1e3:.0f}" if seconds >= 1e-3 else f"{seconds * 1e3:.2g}"


def _params(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _unit(results: Sequence[Capacity]) -> tuple[str, int]:
    """GiB, or MiB where every byte count of the table is below one GiB."""
    counts = [n for r in results for p in r.planned
              for n in (p.device_peak_bytes, p.host_bytes, p.bytes_to_device, p.bytes_to_host)]
    return ("GiB", 1 << 30) if max(counts, default=0) >= 1 << 30 else ("MiB", 1 << 20)


def capacity_table(results: Sequence[Capacity]) -> str:
    """A Markdown table of `capacity` results: per target and mode, the largest model
    that fits, what its step holds and moves, its floors (in GiB, or in MiB for a
    table of small models) and the settings its run needs (`GpuPlan.run_settings()`,
    the plan summary's "run with:" line)."""
    unit, size = _unit(results)

    def b(n: int) -> str:
        return f"{n / size:.1f}"

    lines = [
        f"| GPU | mode | largest that fits | params | device peak ({unit}) | host ({unit}) "
        f"| moved per step, to device / to host ({unit}) | compute floor (ms) "
        "| transfer floor (ms) | floor ratio | run with | next size up: why not |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in results:
        gpu = r.target.upper() + ("" if r.n_devices == 1 else f" x {r.n_devices}")
        why = "" if r.first_too_large is None else _why_not(r.first_too_large)
        p = r.largest
        if p is None:
            lines.append(f"| {gpu} | {r.mode.name} | none | | | | | | | | | {why} |")
            continue
        params = _params(p.params)
        lines.append(
            f"| {gpu} | {r.mode.name} | {p.shape.name} | {params} "
            f"| {b(p.device_peak_bytes)} | {b(p.host_bytes)} "
            f"| {b(p.bytes_to_device)} / {b(p.bytes_to_host)} "
            f"| {_ms(p.compute_floor_s)} | {_ms(p.transfer_floor_s)} "
            f"| {p.floor_ratio:.2f} | {settings_text(p.run_settings)} | {why} |")
    return "\n".join(lines)


def capacity_from_records(records: Sequence[dict[str, Any]]) -> list[Capacity]:
    """The `Capacity` results a `--json` file of `plan --capacity` holds (its table
    again, e.g. with columns added since, without planning)."""
    results = []
    for r in records:
        planned = [point_from_record(p) for p in r["planned"]]
        largest = None if r["largest"] is None else point_from_record(r["largest"])
        above = [p for p in planned if largest is None or p.params > largest.params]
        results.append(Capacity(MODES_BY_NAME[r["mode"]], r["target"], r["n_devices"], largest,
                                min(above, key=lambda p: p.params, default=None),
                                tuple(planned)))
    return results


def _why_not(p: CapacityPoint) -> str:
    if p.error is not None:
        return f"{p.shape.name}: XLA could not compile it ({p.error[:80]}...)"
    if p.from_arguments:
        reasons = []
        if p.device_peak_bytes > p.device_memory_bytes:
            reasons.append(f"its weights and state alone {size_text(p.device_peak_bytes)} > "
                           f"{size_text(p.device_memory_bytes)} on the device")
        if p.host_bytes > p.host_memory_bytes:
            reasons.append(f"its weights and state alone {size_text(p.host_bytes)} > "
                           f"{size_text(p.host_memory_bytes)} of host memory")
        return f"{p.shape.name} ({_params(p.params)}): " + ", ".join(reasons) + " (not compiled)"
    return f"{p.shape.name} ({_params(p.params)}): " + ", ".join(over_limits(p))


QUICK_LADDER: tuple[LlamaShape, ...] = (
    LlamaShape("tiny 2L", 128, 2, 4, 2, 256, 512, seq=128),
    LlamaShape("tiny 4L", 128, 4, 4, 2, 256, 512, seq=128),
    LlamaShape("tiny 8L", 128, 8, 4, 2, 256, 512, seq=128),
)
"""The ladder of `--quick`: three small depths of one small shape."""


def _gpus(spec: str) -> list[tuple[str, int]]:
    gpus = []
    for token in (t.strip().lower() for t in spec.split(",") if t.strip()):
        name, _, count = token.partition("x")
        if name not in eqx_offload.GPU_TARGETS or (count and not count.isdigit()):
            raise SystemExit(f"eqx_offload plan --capacity: unknown GPU {token!r} (h100, h200, "
                             "or NAMExN for a node of N)")
        gpus.append((name, int(count or 1)))
    return gpus


def _mesh(n: int) -> Optional[jax.sharding.Mesh]:
    """A one-axis mesh of `n` of this machine's devices (the plan sizes a topology of as
    many GPUs), or `None` for one."""
    if n == 1:
        return None
    if len(jax.devices()) < n:
        raise SystemExit(f"eqx_offload plan --capacity: a node of {n} GPUs needs {n} devices "
                         f"here, and JAX has {len(jax.devices())} (it started before "
                         "jax_num_cpu_devices could be set)")
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))


def _start(done: Sequence[Capacity], mode: CapacityMode, target: str, n: int,
           shapes: Sequence[LlamaShape]) -> list[int]:
    """Where the search for `mode` on `target` starts: the answers so far of the modes
    in `mode.after` on the same GPUs, and of `mode` on as many GPUs with no more memory
    each (guesses that `largest_fitting` checks first, the largest first)."""
    memory = eqx_offload.GPU_TARGETS[target].device_memory_size
    found = [shapes.index(r.largest.shape) for r in done
             if r.largest is not None and r.largest.shape in shapes and r.n_devices == n
             and ((r.target == target and r.mode.name in mode.after)
                  or (r.mode.name == mode.name
                      and eqx_offload.GPU_TARGETS[r.target].device_memory_size <= memory))]
    return sorted(set(found), reverse=True)


QUICK_DEFAULTS = {"gpus": "h100", "device_memory": 12.0, "capacity_modes": "fp32,+master,+activations"}
"""What `--quick` plans unless told otherwise: one H100 cut to 12 MiB, three modes."""

FULL_GPUS = "h100,h200,h100x8"


def _defaults(args: Any) -> Any:
    """`args` with the `--quick` (or full) defaults of the options left unset."""
    quick = QUICK_DEFAULTS if args.quick else {"gpus": FULL_GPUS}
    return argparse.Namespace(**{**vars(args), **{k: v for k, v in quick.items()
                                                  if getattr(args, k, None) is None}})


def _progress(p: CapacityPoint) -> None:
    print(f"  {p.target}{'' if p.n_devices == 1 else f' x {p.n_devices}'} {p.mode:13s} "
          f"{p.shape.name:32s} {_params(p.params):>7s}  device {size_text(p.device_peak_bytes):>10s}"
          f"  host {size_text(p.host_bytes):>10s}  {'fits' if p.fits else 'does not fit'}"
          f"{'' if p.error is None else ' (XLA: ' + p.error[:60] + ')'}"
          f"{' (the arguments alone)' if p.from_arguments else ''}  [{p.plan_s:.0f} s]",
          file=sys.stderr, flush=True)


def _search(args: Any, gpus: list[tuple[str, int]], names: list[str]) -> list[Capacity]:
    from .llama import ladder

    base = QUICK_LADDER if args.quick else tuple(ladder())
    shapes = [dataclasses.replace(s, batch=args.micro_batch) for s in base]
    device_memory = None if args.device_memory is None else int(args.device_memory * (1 << 20))
    results: list[Capacity] = []
    cache = PointCache(getattr(args, "cache", None))
    for target, n in gpus:
        mesh = _mesh(n)
        for name in names:
            mode = MODES_BY_NAME[name]
            results.append(capacity(shapes, mode, target, int(args.host_memory * GB) * n, mesh,
                                    device_memory, _progress, _start(results, mode, target, n,
                                                                     shapes), cache))
    return results


def run_capacity(args: Any) -> int:
    """`python -m eqx_offload plan --capacity`: the capacity table (with
    `--micro-batches`, the batch table of `capacity_batch`)."""
    args = _defaults(args)
    gpus = _gpus(args.gpus)
    most = max(n for _, n in gpus)
    if most > 1:
        try:  # before JAX starts its CPU backend (as the command line does)
            jax.config.update("jax_num_cpu_devices", most)
        except (RuntimeError, ValueError):
            pass  # started already (e.g. in tests): `_mesh` checks what there is
    names = (args.capacity_modes or ",".join(m.name for m in CAPACITY_MODES)).split(",")
    unknown = [n for n in names if n not in MODES_BY_NAME]
    if unknown:
        print(f"eqx_offload plan --capacity: unknown mode(s) {', '.join(unknown)}; choose from "
              f"{', '.join(MODES_BY_NAME)}", file=sys.stderr)
        return 2
    if getattr(args, "micro_batches", None):
        from .capacity_batch import run_batch

        return run_batch(args, gpus, names, _search, _mesh)
    results = _search(args, gpus, names)
    table = capacity_table(results)
    print(table)
    print(f"\nXLA's plan of one AdamW training step per point (compiled without a GPU, not a "
          f"measurement), sequence {results[0].planned[0].shape.seq if results else ''}, "
          f"{args.micro_batch} sequence(s) per GPU, "
          f"{args.host_memory:g} GB of host memory per GPU. The floors are lower bounds, not "
          "predictions: matrix-product flops at the GPU's peak rate, and the larger "
          "direction of the copies at the host link's rate (PCIe 5.0 x16, 64 GB/s each way).")
    write_outputs(args.markdown, args.json, table, [
        {"mode": r.mode.name, "target": r.target, "n_devices": r.n_devices,
         "largest": None if r.largest is None else point_record(r.largest),
         "planned": [point_record(p) for p in r.planned]} for r in results])
    return 0

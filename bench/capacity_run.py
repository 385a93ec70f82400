"""`python bench/capacity_run.py`: the command line of the capacity planner
(`capacity`, `capacity_batch`), its table and its `--quick` ladder. A script of the
repository, not of the package (the Llama ladder is no part of the library); it runs
on the CPU (`--platform` as `python -m eqx_offload plan`) and needs the `plan` extra."""

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any, Optional

import jax
import numpy as np

import eqx_offload
from eqx_offload.planner import TPU_TARGETS

from capacity import (Capacity, CapacityPoint, GB, over_limits, PointCache, capacity,
                      point_from_record, point_record, settings_text, size_text,
                      write_outputs)
from harness import Mode, MODES, MODES_BY_NAME
from llama import LlamaShape


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
    table of small models) and the settings its run needs (`Plan.run_settings()`,
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
    """The `Capacity` results a `--json` file of `bench/capacity_run.py` holds (its table
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
        if name not in {**eqx_offload.planner.GPU_TARGETS, **TPU_TARGETS} or (
                count and not count.isdigit()):
            raise SystemExit(f"capacity_run.py: unknown GPU or TPU {token!r} (h100, h200, "
                             "v5e, v5p, v6e, or NAMExN for a node of N)")
        gpus.append((name, int(count or 1)))
    return gpus


def _mesh(n: int) -> Optional[jax.sharding.Mesh]:
    """A one-axis mesh of `n` of this machine's devices (the plan sizes a topology of as
    many GPUs), or `None` for one."""
    if n == 1:
        return None
    if len(jax.devices()) < n:
        raise SystemExit(f"capacity_run.py: a node of {n} GPUs needs {n} devices "
                         f"here, and JAX has {len(jax.devices())} (it started before "
                         "jax_num_cpu_devices could be set)")
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))


def _start(done: Sequence[Capacity], mode: Mode, target: str, n: int,
           shapes: Sequence[LlamaShape]) -> list[int]:
    """Where the search for `mode` on `target` starts: the answers so far of the modes
    in `mode.after` on the same GPUs, and of `mode` on as many GPUs with no more memory
    each (guesses that `largest_fitting` checks first, the largest first)."""
    chips = {**eqx_offload.planner.GPU_TARGETS, **TPU_TARGETS}
    memory = chips[target].device_memory_size
    found = [shapes.index(r.largest.shape) for r in done
             if r.largest is not None and r.largest.shape in shapes and r.n_devices == n
             and ((r.target == target and r.mode.name in mode.after)
                  or (r.mode.name == mode.name
                      and chips[r.target].device_memory_size <= memory))]
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
    from llama import ladder

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
    """`python -m capacity_run.py`: the capacity table (with
    `--micro-batches`, the batch table of `capacity_batch`)."""
    args = _defaults(args)
    gpus = _gpus(args.gpus)
    most = max(n for _, n in gpus)
    if most > 1:
        try:  # before JAX starts its CPU backend (as the command line does)
            jax.config.update("jax_num_cpu_devices", most)
        except (RuntimeError, ValueError):
            pass  # started already (e.g. in tests): `_mesh` checks what there is
    names = (args.capacity_modes or ",".join(m.name for m in MODES)).split(",")
    unknown = [n for n in names if n not in MODES_BY_NAME]
    if unknown:
        print(f"capacity_run.py: unknown mode(s) {', '.join(unknown)}; choose from "
              f"{', '.join(MODES_BY_NAME)}", file=sys.stderr)
        return 2
    if getattr(args, "micro_batches", None):
        from capacity_batch import run_batch

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


def add_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the capacity ladder and the batch table."""
    capacity = parser.add_argument_group(
        "capacity", "the largest Llama-style model whose AdamW training step fits each GPU, "
        "per mode (planned from shapes: nothing is allocated)")
    capacity.add_argument("--device-memory", type=float, default=None, metavar="MIB",
                          help="plan within this much device memory (MiB) instead of the GPU's")
    capacity.add_argument("--gpus", default=None,
                          help="comma-separated GPUs or TPUs to size for: h100, h200, v5e, "
                               "v5p, v6e, and NAMExN for a node of N (FSDP over the node; default h100,h200,h100x8, and "
                               "h100 with --quick)")
    capacity.add_argument("--host-memory", type=float, default=256, metavar="GB",
                          help="host memory per GPU, in GB (default 256)")
    capacity.add_argument("--capacity-modes", default=None, metavar="MODES",
                          help="comma-separated modes (default all: "
                               + ",".join(m.name for m in MODES) + ")")
    capacity.add_argument("--micro-batch", type=int, default=1,
                          help="sequences per GPU per step (default 1)")
    capacity.add_argument("--quick", action="store_true",
                          help="a ladder of three small shapes (sequence 128) on one H100 cut "
                               "to 12 MiB (--device-memory), modes fp32,+master,+activations, "
                               "unless those options are given: a smoke test")
    capacity.add_argument("--micro-batches", type=int, default=None, metavar="K",
                          help="the batch table: plan, for each GPU and mode's largest model, "
                               "the optimizer step that scans K micro-batches (--micro-batch "
                               "sequences of --seq-len tokens per GPU each) and updates once, "
                               "and at 2K, and find the smallest global batch within 10%%")
    capacity.add_argument("--accumulate", choices=("float32", "bfloat16"), default="float32",
                          help="the dtype of the batch table's gradient sum, a carry on the "
                               "device (default float32)")
    capacity.add_argument("--accumulate-in",
                          choices=("device", "device-fused", "host", "host-stack"),
                          default="device",
                          help="where the batch table's gradient sum is: a carry on the "
                               "device (default); on the device, the blocks' gradients "
                               "added in their weights' dtype inside the backward scan "
                               "(device-fused, blocks on the device only); in host memory, "
                               "each micro-batch's gradients sent there and added by the "
                               "host's CPU (host); "
                               "each micro-batch's gradients kept in host memory and summed "
                               "there once (host-stack)")
    capacity.add_argument("--seq-len", type=int, default=None, metavar="S",
                          help="tokens per sequence of the batch table (default the ladder's)")
    capacity.add_argument("--models-from", default=None, metavar="PATH",
                          help="the batch table's models: each GPU and mode's largest in this "
                               "capacity JSON (--json of an earlier run) instead of a search")
    capacity.add_argument("--json", default=None, metavar="PATH",
                          help="also write the plans as JSON")
    capacity.add_argument("--markdown", default=None, metavar="PATH",
                          help="also write the capacity table as Markdown")
    capacity.add_argument("--cache", default=None, metavar="PATH",
                          help="keep every planned point in this JSON-lines file and plan "
                               "none of those already in it again (a long run that stops "
                               "resumes where it was)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`), select the platform before JAX starts a
    backend, and run the capacity table."""
    parser = argparse.ArgumentParser(
        prog="bench/capacity_run.py", description="The largest Llama-style model (published "
        "shapes 1B-70B and depths between them) whose training step fits, per GPU and mode.")
    add_capacity_arguments(parser)
    parser.add_argument("--platform", default="cpu",
                        help="JAX platform (default cpu; 'default' lets JAX choose)")
    args = parser.parse_args(argv)
    if args.platform != "default":
        jax.config.update("jax_platforms", args.platform)
    # XLA's GPU compiler warns near its memory limit; the plan's figures are the verdict
    # (docs/gpu-plan.md, "XLA's warnings"): C++ warnings hidden unless asked for.
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") == "1":
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return run_capacity(args)


if __name__ == "__main__":
    sys.exit(main())

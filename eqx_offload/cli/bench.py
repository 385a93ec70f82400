"""`python -m eqx_offload bench`: step time, memory and transfers, side by side.

The modes of `modes.MODES` (baseline, the manual pattern of JAX's host-offloading
tutorial, `eqx_offload` and its variants) train the same model on the same data: an MLP
over a sweep of sizes and a small transformer language model, for each optimizer. In the
same interleaved rotation, two bare copies of the optimizer state's offloaded bytes (host
to device, device to host) measure the transfer floor of each point.

Repetitions are interleaved (one step of each mode and one of each copy in turn, in a
rotating order) so that a slow moment of a shared machine hits every mode alike; ratios
to the baseline and to the floor are medians of per-repetition ratios.
"""

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Optional, Union

import eqx_offload
import jax
import numpy as np

from .config import BenchConfig, WORKLOADS
from .copies import bench_movers, floor, state_copies, StateCopy
from .losscurves import loss_curves
from .measure import (
    bitwise_equal,
    load_average,
    machine_info,
    memory_analysis_dict,
    paired_ratio,
    summary,
)
from .models import LMShape, num_params, OPTIMIZERS, Workload
from .modes import DEFAULT_MODES, MODES, Runner
from .plan import plan_record, plan_step
from .targets import evaluate_targets


# --------------------------------------------------------------------------- one point

def _describe_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".split("\n")[0][:500]


def _device_bytes_nonscalar(tree: Any) -> int:
    return sum(leaf.nbytes for leaf in eqx_offload.memory_report(tree).leaves
               if leaf.memory_kind not in ("pinned_host", "unpinned_host") and leaf.shape)


def measured(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points whose mode ran (not those that failed with an error)."""
    return [p for p in points if p.get("error") is None]


def bench_point(
    workload: Workload, optimizer_name: str, config: BenchConfig, tick: Callable[[], None]
) -> list[dict[str, Any]]:
    """Measure the modes of `config` and the transfer floor on one (workload,
    optimizer). The baseline always runs (the ratios are to it)."""
    batch = workload.batches(1, 0)[0]
    jax.block_until_ready(batch)
    modes = ("baseline",) + tuple(m for m in MODES if m in config.modes and m != "baseline")
    runners, errors = _build_runners(workload, optimizer_name, modes)
    copies = state_copies(OPTIMIZERS[optimizer_name](1e-3), workload.make_model(0))
    jax.block_until_ready([(r.model, r.state) for r in runners])
    count = num_params(runners[0].model)
    _time_interleaved([*runners, *copies], batch, config, errors, tick)
    baseline = runners[0]
    point_floor = floor(copies, baseline.seconds)
    common = {"workload": workload.name, "optimizer": optimizer_name, "params": count,
              "shape": workload.shape, "floor": point_floor}
    results: list[dict[str, Any]] = [
        {**common, "mode": mode, "error": error} for mode, error in errors.items()
    ]
    runners = [r for r in runners if r.mode not in errors]
    manual = next((r for r in runners if r.mode == "manual"), None)
    for runner in runners:
        results.append({
            **common, **_measures(runner, baseline, manual, point_floor, batch),
            "plan": _plans(runner.mode, optimizer_name, workload, batch, config.plan_targets),
        })
    del runners, baseline, manual, copies
    gc.collect()
    order = {mode: i for i, mode in enumerate(MODES)}
    return sorted(results, key=lambda r: order[r["mode"]])


def _build_runners(workload: Workload, optimizer_name: str, modes: tuple[str, ...]
                   ) -> tuple[list[Runner], dict[str, str]]:
    """A runner per mode, and the error of each mode that failed to build.

    A mode that fails (to build, compile or run) is reported with its error and the
    others go on; the baseline must work, the ratios are to it."""
    runners: list[Runner] = []
    errors: dict[str, str] = {}
    for mode in modes:
        optimizer = OPTIMIZERS[optimizer_name](1e-3)
        try:
            runners.append(MODES[mode].build(mode, optimizer, workload.make_model(0),
                                             workload.loss))
        except Exception as e:  # reported in the results (baseline: re-raised)
            if mode == "baseline":
                raise
            errors[mode] = _describe_error(e)
    return runners, errors


def _time_interleaved(rotation: list[Union[Runner, StateCopy]], batch: Any,
                      config: BenchConfig, errors: dict[str, str],
                      tick: Callable[[], None]) -> None:
    """Run one step of each mode and one of each copy in turn, in a rotating order, for
    `config.warmup + config.repeats` repetitions; record the times in the items and a
    mode's error in `errors` (its later turns are skipped)."""
    for rep in range(config.warmup + config.repeats):
        shift = rep % len(rotation)
        for item in rotation[shift:] + rotation[:shift]:
            if item.mode in errors:
                tick()
                continue
            try:
                elapsed, cpu = item.run(batch)
            except Exception as e:  # reported in the results (baseline, copies: re-raised)
                if item.mode == "baseline" or isinstance(item, StateCopy):
                    raise
                errors[item.mode] = _describe_error(e)
                tick()
                continue
            if isinstance(item, StateCopy):
                if rep >= config.warmup:
                    item.seconds.append(elapsed)
            elif rep == 0:
                item.first_call = elapsed
            elif rep >= config.warmup:
                item.seconds.append(elapsed)
                item.cpu_seconds.append(cpu)
            tick()


def _measures(runner: Runner, baseline: Runner, manual: Optional[Runner],
              point_floor: dict[str, Any], batch: Any) -> dict[str, Any]:
    """One mode's record at a point: times and their ratios, bytes, compilations."""
    compiled = runner.compile(runner.model, runner.state, batch)
    params_report = eqx_offload.memory_report(runner.model)
    state_report = eqx_offload.memory_report(runner.state)
    losses = np.stack([np.asarray(v) for v in runner.losses])
    base_losses = np.stack([np.asarray(v) for v in baseline.losses])
    return {
        "mode": runner.mode,
        "error": None,
        "bitwise_expected": MODES[runner.mode].bitwise,
        "step_seconds": summary(runner.seconds),
        "ratio_to_baseline": paired_ratio(runner.seconds, baseline.seconds),
        "ratio_to_manual": (
            paired_ratio(runner.seconds, manual.seconds) if manual is not None else None),
        "ratio_to_floor": paired_ratio(runner.seconds,
                                       point_floor["full_duplex_seconds"]["all"]),
        "ratio_to_no_overlap_floor": paired_ratio(runner.seconds,
                                                  point_floor["no_overlap_seconds"]["all"]),
        # CPU time of this process (all its threads) per step: on the CPU backend,
        # the work a step does, whatever else the machine runs at the same time.
        "cpu_seconds": summary(runner.cpu_seconds),
        "cpu_ratio_to_baseline": paired_ratio(runner.cpu_seconds, baseline.cpu_seconds),
        "first_call_seconds": runner.first_call,
        "compile_seconds": runner.counter.seconds,
        "compilations": runner.counter.count,
        "params_device_bytes": params_report.device_bytes,
        "params_host_bytes": params_report.host_bytes,
        "opt_state_device_bytes": state_report.device_bytes,
        "opt_state_nonscalar_device_bytes": _device_bytes_nonscalar(runner.state),
        "opt_state_host_bytes": state_report.host_bytes,
        "opt_state_by_kind": state_report.by_kind,
        "memory_analysis": memory_analysis_dict(compiled),
        "losses_bitwise_equal_to_baseline": bitwise_equal(losses, base_losses),
        "losses_max_rel_diff": float(np.max(np.abs(losses - base_losses)
                                            / np.maximum(np.abs(base_losses), 1e-30))),
        "final_loss": float(losses[-1]),
    }


def _plans(mode: str, optimizer_name: str, workload: Workload, batch: Any,
           targets: tuple[str, ...]) -> Optional[dict[str, Any]]:
    """XLA's plan of this point's step for each GPU target (`None`: none asked for, or
    the manual pattern, which is not an `eqx_offload.filter_jit` step)."""
    if not targets or mode == "manual":
        return None
    plans: dict[str, Any] = {}
    for target in targets:
        try:
            plan = plan_step(mode, OPTIMIZERS[optimizer_name](1e-3), workload.make_model(0),
                             batch, workload.loss, target=target)
            plans[target] = plan_record(plan)
        except Exception as e:  # noqa: BLE001 - reported in the results
            plans[target] = {"error": _describe_error(e)}
    return plans


# --------------------------------------------------------------------------- the run

def run_bench(config: BenchConfig, progress: bool = True,
              partial: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Run every measurement of `config`; return the result as a JSON-able dict.
    `partial`, if given, receives what was measured so far after each point."""
    from tqdm.auto import tqdm

    workloads = config.workload_list()
    modes = {"baseline", *config.modes} & set(MODES)
    steps = sum(len(config.optimizers_for(w)) for w in workloads) * (len(modes) + 2) * (
        config.warmup + config.repeats)
    steps += len(config.mover_mib) * (config.mover_repeats + 1)
    started = time.perf_counter()
    load_start = load_average()
    points: list[dict[str, Any]] = []
    skipped: list[str] = []

    def out_of_time(what: str) -> bool:
        late = (config.time_limit is not None
                and time.perf_counter() - started > config.time_limit)
        if late:
            skipped.append(what)
        return late

    with tqdm(total=steps, desc="bench", disable=not progress, unit="step",
              dynamic_ncols=True, file=sys.stderr) as bar:
        def tick() -> None:
            bar.update(1)

        for workload in workloads:
            for optimizer_name in config.optimizers_for(workload):
                what = f"{workload.name} {optimizer_name} {workload.shape}"
                if out_of_time(what):
                    continue
                bar.set_postfix_str(f"{workload.name} {optimizer_name}")
                points.extend(bench_point(workload, optimizer_name, config, tick))
                if partial is not None:
                    partial({"config": _config_json(config), "points": points})
        bar.set_postfix_str("movers")
        movers = bench_movers(config.mover_mib, config.mover_repeats, tick)
    curves = loss_curves(config, progress, out_of_time)
    machine = machine_info()
    # Other processes share the machine: its load says how much (1-minute averages).
    machine["load_average_start"] = load_start
    machine["load_average_end"] = load_average()
    return {
        "machine": machine,
        "config": _config_json(config),
        "modes": {name: MODES[name].description for name in MODES},
        "points": points,
        "movers": movers,
        "loss_curves": curves,
        "skipped": skipped,
        "targets": evaluate_targets(points, movers, curves, config.target_min_params,
                                    machine["backend"]),
        "wall_seconds": time.perf_counter() - started,
    }


def _config_json(config: BenchConfig) -> dict[str, Any]:
    result = dataclasses.asdict(config)
    result["lm_params"] = config.lm.params
    return result


def failures(result: dict[str, Any]) -> list[str]:
    """What makes the run fail: a mode that did not run, a bitwise mode whose losses
    differ from the baseline's, a loss curve that could not be measured."""
    found = []
    for p in result["points"]:
        where = f"{p['mode']} ({p['workload']} {p['optimizer']}, {p['params']:,} params)"
        if p.get("error") is not None:
            found.append(f"{where}: {p['error']}")
        elif p["bitwise_expected"] and not p["losses_bitwise_equal_to_baseline"]:
            found.append(f"{where}: losses differ from the baseline's")
    for c in result["loss_curves"]:
        if c.get("error") is not None:
            found.append(f"loss curve {c['mode']} ({c['workload']}): {c['error']}")
        elif MODES[c["mode"]].bitwise and not c["bitwise_equal"]:
            found.append(f"loss curve {c['mode']} ({c['workload']}): differs from the "
                         "baseline's")
    return found


def bench_main(config: BenchConfig, out: str, progress: bool = True) -> int:
    """Run the benchmark, print the tables, write `bench.json`, `bench.md` and the
    plots to `out`. Returns 1 if a mode failed to run or a bitwise mode's losses differ
    from the baseline's (a correctness failure), else 0: missed performance targets are
    reported, not fatal."""
    from rich.console import Console

    from .plots import plots
    from .tables import markdown, render

    os.makedirs(out, exist_ok=True)
    partial_path = os.path.join(out, "bench.partial.json")

    def partial(so_far: dict[str, Any]) -> None:
        with open(partial_path, "w") as f:
            json.dump(so_far, f, indent=1)

    result = run_bench(config, progress, partial)
    if os.path.exists(partial_path):
        os.remove(partial_path)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(markdown(result))
    written = plots(result, out)
    console = Console(width=100)
    console.print(render(result))
    console.print(f"wrote {os.path.join(out, 'bench.json')}, {os.path.join(out, 'bench.md')}, "
                  + ", ".join(written) + f" ({result['wall_seconds']:.0f} s)")
    problems = failures(result)
    for what in result["skipped"]:
        console.print(f"[yellow]skipped (time limit)[/yellow]: {what}")
    for problem in problems:
        console.print(f"[bold red]failed[/bold red]: {problem}")
    return 1 if problems else 0


# --------------------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m eqx_offload bench`."""
    modes = "; ".join(f"{name}: {mode.description}" for name, mode in MODES.items())
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: one small MLP with Adam, every default mode, "
                             "3 timed steps (the other options still apply)")
    parser.add_argument("--out", default="bench-out", help="output folder (default bench-out)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS,
                        help="what to train (default: both)")
    parser.add_argument("--sizes", type=float, nargs="+", metavar="N",
                        help="MLP parameter counts to sweep (e.g. 1e6 3e7)")
    parser.add_argument("--optimizers", nargs="+", choices=sorted(OPTIMIZERS))
    parser.add_argument("--lm-optimizers", nargs="+", choices=sorted(OPTIMIZERS),
                        help="the transformer's optimizers (default: --optimizers)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), metavar="MODE",
                        help=f"modes to measure (default: {' '.join(DEFAULT_MODES)}; the "
                             f"baseline always runs). {modes}")
    parser.add_argument("--repeats", type=int, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, help="untimed first steps per configuration")
    parser.add_argument("--batch", type=int, help="MLP batch size")
    parser.add_argument("--movers", type=int, nargs="*", metavar="MIB",
                        help="array sizes (MiB) for the eager movers; none to skip them")
    for field in dataclasses.fields(LMShape):
        parser.add_argument(f"--lm-{field.name}", type=int, metavar="N",
                            help=f"transformer {field.name}")
    parser.add_argument("--loss-curves", nargs="+", choices=list(MODES)[1:], metavar="MODE",
                        help="compare these modes' loss curves with the baseline's "
                             "(JSON and loss_curves.png)")
    parser.add_argument("--loss-steps", type=int, help="steps per loss curve")
    parser.add_argument("--loss-optimizer", choices=sorted(OPTIMIZERS),
                        help="optimizer of the loss curves (default adam)")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="skip the points and loss curves not started after this long "
                             "(they are listed in the results); every file is still written")
    parser.add_argument("--plan", nargs="*", choices=sorted(eqx_offload.planner.GPU_TARGETS),
                        metavar="GPU", default=None,
                        help="also record XLA's plan of every point for these GPUs "
                             "(eqx_offload.planner.gpu_plan, compiled without a GPU: device peak, "
                             "copies overlapped; needs the `plan` extra); --plan alone: h200")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def config_from(args: argparse.Namespace) -> BenchConfig:
    """The `BenchConfig` the command line asks for."""
    config = BenchConfig.quick() if args.quick else BenchConfig.full()
    changes: dict[str, Any] = {}
    for name in ("workloads", "sizes", "optimizers", "lm_optimizers", "modes", "loss_curves"):
        if getattr(args, name) is not None:
            changes[name] = tuple(getattr(args, name))
    for name in ("repeats", "warmup", "batch", "loss_steps", "loss_optimizer", "time_limit"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.movers is not None:
        changes["mover_mib"] = tuple(args.movers)
    if args.plan is not None:
        changes["plan_targets"] = tuple(args.plan) or ("h200",)
    lm = {f.name: getattr(args, f"lm_{f.name}") for f in dataclasses.fields(LMShape)
          if getattr(args, f"lm_{f.name}") is not None}
    if lm:
        changes["lm"] = dataclasses.replace(config.lm, **lm)
    return config.replace(**changes)


def run(args: argparse.Namespace) -> int:
    """`python -m eqx_offload bench`."""
    return bench_main(config_from(args), args.out, progress=not args.no_progress)

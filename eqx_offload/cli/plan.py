"""`python -m eqx_offload plan`: XLA's plan of a training step for an NVIDIA GPU or a
TPU, compiled on this machine without one (`eqx_offload.plan`).

Plans the benchmark's models (an MLP or the transformer LM, at any size) in the modes
of the benchmark's table, side by side with the step without offload, or a step of
your own: `--step package.module:function`, where `function()` returns
`(step, args)` or `(step, args, kwargs)` with `step` an `eqx_offload.filter_jit`
function (a plain function is planned as `eqx_offload.filter_jit(step)`).

Every number is XLA's plan (its buffer assignment and schedule for the target), not a
measurement. (The capacity search over Llama-style models that the GPU-plan page
reports is a script of the repository, `python bench/capacity_run.py`, not a command.)
Needs the `plan` extra (jax-cuda12-plugin at the installed JAX version,
nvidia-cuda-nvcc-cu12) for a GPU, libtpu (`jax[tpu]` at that version) for a TPU."""

import argparse
import dataclasses
import importlib
import json
import os
import sys
from typing import Any

import equinox as eqx
import optax

import eqx_offload
from eqx_offload.planner import TPU_TARGETS

from .models import LMShape, lm_workload, make_mlp, make_step, mse_loss, OPTIMIZERS, regression_batches
from .modes import MODES


MiB = 1 << 20
PLAN_MODES = ("baseline", "eqx_offload", "whole_state", "streamed", "host_compute")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("mlp", "transformer"), default="mlp",
                        help="the benchmark's model to plan (default mlp)")
    parser.add_argument("--width", type=int, default=1024, help="model width (default 1024)")
    parser.add_argument("--depth", type=int, default=4,
                        help="MLP hidden layers, or transformer blocks (default 4)")
    parser.add_argument("--batch", type=int, default=8192,
                        help="batch size: rows for the MLP, sequences for the transformer")
    parser.add_argument("--seq", type=int, default=512, help="transformer sequence length")
    parser.add_argument("--vocab", type=int, default=8192, help="transformer vocabulary")
    parser.add_argument("--heads", type=int, default=8, help="transformer attention heads")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    parser.add_argument("--modes", default=",".join(PLAN_MODES),
                        help=f"comma-separated modes of the benchmark (default {','.join(PLAN_MODES)}; "
                             "'baseline' is the step without offload)")
    parser.add_argument("--step", default=None, metavar="MODULE:FUNCTION",
                        help="plan your own step instead: FUNCTION() returns (step, args) or "
                             "(step, args, kwargs)")
    parser.add_argument("--target", choices=sorted({*eqx_offload.planner.GPU_TARGETS, *TPU_TARGETS}),
                        default="h200", help="the GPU or TPU to plan for (default h200)")
    parser.add_argument("--device-memory", type=float, default=None, metavar="MIB",
                        help="plan within this much device memory (MiB) instead of the GPU's")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the plans as JSON")


def plan_record(plan: eqx_offload.planner.Plan) -> dict[str, Any]:
    """A plan as plain data (for JSON and the benchmark's tables)."""
    record: dict[str, Any] = {
        k: v for k, v in dataclasses.asdict(plan).items() if k not in ("copies", "compiler_options")}
    record["compiler_options"] = dict(plan.compiler_options)
    record["fits"] = plan.fits
    for direction in ("to_device", "to_host"):
        copies = plan.copies_to(direction)
        record[f"copies_{direction}"] = len(copies)
        record[f"overlapped_{direction}"] = sum(c.overlapped for c in copies)
        record[f"bytes_{direction}"] = sum(c.nbytes for c in copies)
        record[f"overlapped_bytes_{direction}"] = plan.overlapped_fraction(direction, by="bytes")
    return record


def plan_step(name: str, optimizer: optax.GradientTransformation, model: Any, batch: Any,
              loss: Any, **kwargs: Any) -> eqx_offload.planner.Plan:
    """The plan of the benchmark's step in mode `name` (`baseline`: no offload)."""
    mode = MODES[name]
    wrapped = optimizer if mode.options is None else eqx_offload.offloaded(optimizer, **mode.options)
    state = wrapped.init(eqx.filter(model, eqx.is_array))
    step = eqx_offload.filter_jit(make_step(wrapped, loss), donate="all")
    return eqx_offload.plan(step, model, state, batch, **kwargs)


def _user_step(spec: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    module, _, function = spec.partition(":")
    if not module or not function:
        raise SystemExit(f"eqx_offload plan: --step must be MODULE:FUNCTION, got {spec!r}")
    made = getattr(importlib.import_module(module), function)()
    step, args, *rest = made
    return step, tuple(args), dict(rest[0]) if rest else {}


def _row(label: str, plan: eqx_offload.planner.Plan, baseline: Any) -> str:
    to_device, to_host = plan.copies_to("to_device"), plan.copies_to("to_host")
    ratio = "" if baseline is None else f"{plan.device_peak_bytes / baseline.device_peak_bytes:6.2f}x"
    return (f"| {label} | {plan.device_peak_bytes / MiB:.1f} | {ratio} | "
            f"{plan.host_bytes / MiB:.1f} | {sum(c.overlapped for c in to_device)}/{len(to_device)} | "
            f"{sum(c.overlapped for c in to_host)}/{len(to_host)} | "
            f"{'yes' if plan.fits else 'NO'} |")


def run(args: argparse.Namespace) -> int:
    # XLA's GPU compiler warns "Can't reduce memory use below ... by rematerialization"
    # for steps near its memory limit and for offloaded steps, whose host buffers its
    # estimate counts: the plan's figures and `fits` are the verdict (docs/gpu-plan.md,
    # "XLA's warnings"). Raised from JAX's default level 1 (which `import jax` sets)
    # to 2, which hides C++ warnings; TF_CPP_MIN_LOG_LEVEL=0 shows them.
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") == "1":
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    kwargs: dict[str, Any] = {"target": args.target}
    if args.device_memory is not None:
        kwargs["device_memory"] = int(args.device_memory * MiB)
    plans: dict[str, eqx_offload.planner.Plan] = {}
    try:
        if args.step is not None:
            step, step_args, step_kwargs = _user_step(args.step)
            plans["your step"] = eqx_offload.plan(step, *step_args, **kwargs, **step_kwargs)
        else:
            modes = [m.strip() for m in args.modes.split(",") if m.strip()]
            unknown = [m for m in modes if m not in MODES or m == "manual"]
            if unknown:
                print(f"eqx_offload plan: unknown mode(s) {', '.join(unknown)}; choose from "
                      f"{', '.join(m for m in MODES if m != 'manual')}", file=sys.stderr)
                return 2
            optimizer = OPTIMIZERS[args.optimizer](1e-3)
            loss: Any
            if args.workload == "mlp":
                model = make_mlp(args.width, args.depth, args.width, 0)
                batch = regression_batches(args.width, args.batch, 1, 0)[0]
                loss = mse_loss
            else:
                workload = lm_workload(LMShape(vocab=args.vocab, width=args.width, layers=args.depth,
                                               heads=args.heads, seq=args.seq, batch=args.batch))
                model, batch, loss = workload.make_model(0), workload.batches(1, 0)[0], workload.loss
            for name in modes:
                plans[name] = plan_step(name, optimizer, model, batch, loss, **kwargs)
    except eqx_offload.errors.PlanError as error:
        print(f"eqx_offload plan: {error}", file=sys.stderr)
        return 2
    baseline = plans.get("baseline")
    for name, plan in plans.items():
        print(f"--- {name}\n{plan.summary()}\n")
    print("| mode | device peak (MiB) | x baseline | host (MiB) | copies to device overlapped "
          "| copies to host overlapped | fits |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, plan in plans.items():
        print(_row(name, plan, baseline))
    print("\nXLA's plan, compiled without the chip: not a measurement.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: plan_record(plan) for name, plan in plans.items()}, f, indent=1)
    return 0

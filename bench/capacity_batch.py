"""The capacity table for a batch: what an optimizer step of many tokens costs when it
scans its micro-batches, accumulates their gradients and updates once.

`python bench/capacity_run.py --micro-batches K` plans, for each GPU and
mode, the step that runs `jax.lax.scan` over `K` micro-batches (the gradients summed
in an fp32 carry on the device, or in host memory: `--accumulate-in`) and then one
AdamW update: the optimizer state, where
it waits in host memory, crosses once per optimizer step, whatever `K`. It plans that
step at `K` and at `2K` micro-batches (XLA's plan, compiled without a GPU) and fits a
line through the two: the matrix-product flops (hence the compute floor) grow with
`K`; the bytes that cross split into a part per optimizer step (the state) and a part
per micro-batch (the blocks' weights and inputs, where those wait in host memory).
From the line it finds the smallest global batch (tokens per optimizer step, a power
of two) at which the transfer floor is at most a tenth of the compute floor
(`smallest_batch`). The floors are lower bounds, not predictions of the step time.
"""

import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_offload

from capacity import (abstract_tokens, argument_bytes, GB, over_limits, plan_fits,
                      settings_text, size_text, training_update, write_outputs)
from harness import host_compute, Mode, MODES_BY_NAME
from llama import llama_loss, LlamaShape


def _add(acc: jax.Array, grad: jax.Array) -> jax.Array:
    # A weight in host memory has its gradient there: the sum is on the device.
    return acc + eqx_offload.to_device(grad).astype(acc.dtype)


def _on_host(x: Any) -> bool:
    return bool(jax.typeof(x).memory_space == jax.memory.Space.Host)


def _mean(k: int, total: jax.Array, param: jax.Array) -> jax.Array:
    mean = (total / k).astype(param.dtype)
    return eqx_offload.to_host(mean) if _on_host(param) else mean


def _zeros(dtype: Any, x: Any) -> jax.Array:
    return jnp.zeros(x.shape, dtype)


def _host_add(acc: jax.Array, grad: jax.Array) -> jax.Array:
    return acc + grad.astype(acc.dtype)


def _host_mean(k: int, total: jax.Array, param: jax.ShapeDtypeStruct) -> jax.Array:
    return (total / k).astype(param.dtype)


def _struct(dtype: Optional[Any], x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype if dtype is None else dtype)


def _to_host(grad: jax.Array) -> jax.Array:
    return grad if _on_host(grad) else eqx_offload.to_host(grad)


def _space(param: jax.Array) -> Any:
    return jax.typeof(param).memory_space


def _on_cpu(f: Callable[..., Any]) -> Callable[..., Any]:
    """`f` run by the host's CPU on host memory, its results typed for host memory
    (`compute_on` with `compute_type="device_host"`, as `offloaded(..., compute="host")`
    runs). XLA's GPU plan writes a host computation's results to device memory and
    copies them to host (docs/capacity.md)."""
    on_host: Callable[..., Any] = host_compute(
        f, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    return on_host


def accumulating_step(update: Callable[..., Any], accumulate: Any = jnp.float32,
                      accumulate_in: str = "device") -> Callable[..., Any]:
    """The training step that scans its micro-batches (`tokens` of shape `(K, batch,
    seq + 1)`), sums their gradients in a carry of dtype `accumulate`, and applies
    `update(model, state, mean_grads)` once: the idiom whose optimizer state crosses
    once per optimizer step. `accumulate_in="device"`: the sum is on the device (no
    traffic); `"device-fused"`: on the device, the blocks' part in their weights'
    dtype and added layer by layer in the backward scan (`scan_layers(...,
    accumulate=...)`: no second gradient buffer of the blocks); `"host"`: in host
    memory, each micro-batch's gradients cross to the host once and the host's CPU adds
    them there (nothing comes back per micro-batch); the mean comes to the device once,
    in the weights' dtype, for the update."""
    if accumulate_in == "host":
        return _host_accumulating_step(update, accumulate)
    if accumulate_in == "host-stack":
        return _stacking_step(update, accumulate)
    fused = accumulate_in == "device-fused"

    @eqx_offload.filter_jit(donate="all")
    def step(model: Any, state: Any, tokens: jax.Array) -> Any:
        def micro(acc: Any, batch: jax.Array) -> tuple[Any, None]:
            if fused:  # the blocks' gradient comes as acc.blocks + theirs
                grads = eqx.filter_grad(llama_loss)(model, batch, acc.blocks)
                rest = jax.tree.map(_add, eqx.tree_at(_blocks, acc, None),
                                    eqx.tree_at(_blocks, grads, None))
                return eqx.tree_at(_blocks, rest, grads.blocks, is_leaf=_is_none), None
            return jax.tree.map(_add, acc, eqx.filter_grad(llama_loss)(model, batch)), None

        params = eqx.filter(model, eqx.is_inexact_array)
        zeros = jax.tree.map(functools.partial(_zeros, accumulate), params)
        if fused:  # the blocks' sum in their weights' dtype, as scan_layers adds it
            zeros = eqx.tree_at(_blocks, zeros, jax.tree.map(jnp.zeros_like, params.blocks))
        total, _ = jax.lax.scan(micro, zeros, tokens)
        grads = jax.tree.map(functools.partial(_mean, tokens.shape[0]), total, params)
        return update(model, state, grads)
    return step


def _blocks(tree: Any) -> Any:
    return tree.blocks


def _is_none(x: Any) -> bool:
    return x is None


def _host_accumulating_step(update: Callable[..., Any], accumulate: Any) -> Callable[..., Any]:
    """`accumulating_step` with the gradient sum in host memory."""
    @eqx_offload.filter_jit(donate="all")
    def step(model: Any, state: Any, tokens: jax.Array) -> Any:
        def micro(acc: Any, batch: jax.Array) -> tuple[Any, None]:
            grads = jax.tree.map(_to_host, eqx.filter_grad(llama_loss)(model, batch))
            return _on_cpu(functools.partial(jax.tree.map, _host_add))(acc, grads), None

        params = eqx.filter(model, eqx.is_inexact_array)
        # The host makes the zeros and the mean: no array of the sum's size on the device.
        wide = jax.tree.map(functools.partial(_struct, accumulate), params)
        zeros = _on_cpu(lambda: jax.tree.map(functools.partial(_zeros, accumulate), wide))()
        total, _ = jax.lax.scan(micro, zeros, tokens)
        like = jax.tree.map(functools.partial(_struct, None), params)
        # The mean in the weights' dtype and memory: once to the device for the update.
        def mean_of(t: Any) -> Any:
            return jax.tree.map(functools.partial(_host_mean, tokens.shape[0]), t, like)

        mean = host_compute(mean_of, compute_type="device_host",
                            out_memory_spaces=jax.tree.map(_space, params))(total)
        return update(model, state, mean)
    return step


def _stacking_step(update: Callable[..., Any], accumulate: Any) -> Callable[..., Any]:
    """`accumulating_step` that keeps each micro-batch's gradients in host memory (the
    scan's stacked output) and sums them on the host's CPU once, after the scan."""
    @eqx_offload.filter_jit(donate="all")
    def step(model: Any, state: Any, tokens: jax.Array) -> Any:
        def micro(carry: None, batch: jax.Array) -> tuple[None, Any]:
            return None, jax.tree.map(_to_host, eqx.filter_grad(llama_loss)(model, batch))

        _, stacked = jax.lax.scan(micro, None, tokens)
        params = eqx.filter(model, eqx.is_inexact_array)
        like = jax.tree.map(functools.partial(_struct, None), params)
        def mean_of(s: Any) -> Any:
            return jax.tree.map(functools.partial(_stack_mean, accumulate), s, like)

        mean = host_compute(mean_of, compute_type="device_host",
                            out_memory_spaces=jax.tree.map(_space, params))(stacked)
        return update(model, state, mean)
    return step


def _stack_mean(accumulate: Any, stacked: jax.Array, param: jax.ShapeDtypeStruct) -> jax.Array:
    # Added in the scan's order, as the carry adds them: the same sum, bit for bit.
    total = stacked[0].astype(accumulate)
    for i in range(1, stacked.shape[0]):
        total = total + stacked[i].astype(accumulate)
    return (total / stacked.shape[0]).astype(param.dtype)


def batch_step(shape: LlamaShape, mode: Mode, micro_batches: int,
               mesh: Optional[jax.sharding.Mesh] = None, accumulate: Any = jnp.float32,
               accumulate_in: str = "device") -> tuple[Any, tuple[Any, ...]]:
    """`(step, (model, state, tokens))`: `accumulating_step` of a `Llama` of `shape`
    in `mode` over `micro_batches` micro-batches, every argument abstract."""
    update, model, state = training_update(shape, mode, mesh)
    tokens = abstract_tokens(shape, mesh, micro_batches)
    return accumulating_step(update, accumulate, accumulate_in), (model, state, tokens)


@dataclasses.dataclass(frozen=True)
class BatchPoint:
    """One planned optimizer step of `micro_batches` micro-batches. XLA's plan.

    **Fields:** `shape` (its `seq` and `batch`: one micro-batch, per device), `mode`,
    `target`, `n_devices`, `micro_batches`, `tokens` (per optimizer step, all
    devices); `device_peak_bytes` (per device), `device_memory_bytes`, `host_bytes`
    (all devices), `host_memory_bytes`, `fits`; `bytes_to_device`, `bytes_to_host`
    (per device, every execution of every copy); `compute_floor_s`,
    `transfer_floor_s` (the plan's, see `Plan`); `matmul_s` (the matrix-product
    flops alone at the GPU's peak rates: the part of the compute floor that grows with
    the micro-batches, exactly, as the flops are counted per scan iteration); `error`
    (XLA's, where it could not compile, or why it was not compiled); `plan_s`;
    `accumulate` (the dtype of the gradient sum), `accumulate_in` (where the sum is,
    and how: `accumulating_step`); `run_settings` (what a run of the step needs beyond
    JAX's defaults: `Plan.run_settings()`).
    """

    shape: LlamaShape
    mode: str
    target: str
    n_devices: int
    micro_batches: int
    tokens: int
    device_peak_bytes: int
    device_memory_bytes: int
    host_bytes: int
    host_memory_bytes: int
    fits: bool
    bytes_to_device: int
    bytes_to_host: int
    compute_floor_s: float
    transfer_floor_s: float
    matmul_s: float
    error: Optional[str]
    plan_s: float
    accumulate: str = "float32"
    accumulate_in: str = "device"
    run_settings: tuple[str, ...] = ()


def plan_batch_point(shape: LlamaShape, mode: Mode, micro_batches: int,
                     target: str = "h100", host_memory: int = 256 * GB,
                     mesh: Optional[jax.sharding.Mesh] = None,
                     device_memory: Optional[int] = None, accumulate: str = "float32",
                     accumulate_in: str = "device") -> BatchPoint:
    """Plan `batch_step` (its gradient sum in `accumulate`, on the device or in host
    memory: `accumulate_in`) for `target` and say whether it fits."""
    start = time.perf_counter()
    n = 1 if mesh is None else mesh.devices.size
    memory = (eqx_offload.planner.GPU_TARGETS[target].device_memory_size if device_memory is None
              else device_memory)
    tokens = micro_batches * shape.batch * shape.seq * n
    step, args = batch_step(shape, mode, micro_batches, mesh, jnp.dtype(accumulate),
                            accumulate_in)
    device_args, host_args = argument_bytes(args)

    def point(peak: int, host: int, fits: bool, moved: tuple[int, int],
              floors: tuple[float, float, float], error: Optional[str] = None,
              settings: Sequence[str] = ()) -> BatchPoint:
        return BatchPoint(shape, mode.name, target, n, micro_batches, tokens, peak, memory,
                          host, host_memory, fits, *moved, *floors, error,
                          time.perf_counter() - start, accumulate, accumulate_in,
                          tuple(settings))

    if device_args > memory or host_args > host_memory:
        return point(device_args, host_args, False, (0, 0), (0.0, 0.0, 0.0),
                     "its weights and state alone do not fit (not compiled)")
    if accumulate_in == "device-fused" and mode.params_on_host:
        return point(device_args, host_args, False, (0, 0), (0.0, 0.0, 0.0),
                     "device-fused needs the blocks' weights on the device (not compiled)")
    try:
        plan = eqx_offload.planner.gpu_plan(step, *args, target=target, device_memory=device_memory,
                                    host_memory=host_memory)
    except eqx_offload.errors.PlanError as error:
        return point(0, 0, False, (0, 0), (0.0, 0.0, 0.0), str(error)[:500])
    return point(plan.device_peak_bytes, plan.host_total_bytes, plan_fits(plan, host_memory),
                 (plan.bytes_moved("to_device"), plan.bytes_moved("to_host")),
                 (plan.compute_floor_seconds, plan.transfer_floor_seconds, _matmul_seconds(plan)),
                 settings=plan.run_settings())


def _matmul_seconds(plan: eqx_offload.planner.Plan) -> float:
    gpu = plan.gpu or eqx_offload.planner.GPU_TARGETS["h100"]
    rates = {"bf16": gpu.bf16_flops, "tf32": gpu.tf32_flops, "fp32": gpu.fp32_flops}
    return sum(n / rates[kind] for kind, n in plan.matmul_flops.items())


@dataclasses.dataclass(frozen=True)
class Line:
    """`value(k) = fixed + per_micro_batch * k`: a quantity of an optimizer step of `k`
    micro-batches, through two plans."""

    fixed: float
    per_micro_batch: float

    def at(self, k: Union[int, float]) -> float:
        return self.fixed + self.per_micro_batch * k


def line(k1: int, v1: float, k2: int, v2: float) -> Line:
    """The line through `(k1, v1)` and `(k2, v2)`."""
    per = (v2 - v1) / (k2 - k1)
    return Line(v1 - per * k1, per)


def smallest_batch(tokens_per_micro_batch: int, compute_s: Line, transfer_s: Line,
                   limit: float = 0.1, most: int = 1 << 30) -> Optional[int]:
    """The smallest global batch (tokens per optimizer step, a power of two and a
    whole number of micro-batches) at which `transfer_s` is at most `limit` times
    `compute_s` (both lines in micro-batches), or `None` if none up to `most` tokens
    (where the transfer per micro-batch alone is more than `limit` of its compute)."""
    tokens = 1 << max(0, math.ceil(math.log2(tokens_per_micro_batch)))
    while tokens <= most:
        k = tokens / tokens_per_micro_batch
        if k == int(k) and transfer_s.at(k) <= limit * compute_s.at(k):
            return tokens
        tokens *= 2
    return None


@dataclasses.dataclass(frozen=True)
class BatchRow:
    """The batch table's row for one GPU and mode: the plans at `k` and `2k`
    micro-batches, the lines through them, and `smallest` (see `smallest_batch`)."""

    low: BatchPoint
    high: BatchPoint
    compute_s: Optional[Line]
    transfer_s: Optional[Line]
    smallest: Optional[int]


def batch_row(shape: LlamaShape, mode: Mode, micro_batches: int, target: str = "h100",
              host_memory: int = 256 * GB, mesh: Optional[jax.sharding.Mesh] = None,
              device_memory: Optional[int] = None,
              progress: Optional[Callable[[BatchPoint], None]] = None,
              accumulate: str = "float32", accumulate_in: str = "device") -> BatchRow:
    """Plan the step of `shape` in `mode` at `micro_batches` and twice as many, and
    extrapolate (see the module's docstring)."""
    points = []
    for k in (micro_batches, 2 * micro_batches):
        points.append(plan_batch_point(shape, mode, k, target, host_memory, mesh, device_memory,
                                       accumulate, accumulate_in))
        if progress is not None:
            progress(points[-1])
    low, high = points
    if low.error is not None or high.error is not None:
        return BatchRow(low, high, None, None, None)
    compute = line(low.micro_batches, low.matmul_s, high.micro_batches, high.matmul_s)
    transfer = line(low.micro_batches, low.transfer_floor_s, high.micro_batches,
                    high.transfer_floor_s)
    per_micro = shape.batch * shape.seq * low.n_devices
    return BatchRow(low, high, compute, transfer, smallest_batch(per_micro, compute, transfer))


def _tokens(n: Optional[int]) -> str:
    if n is None:
        return "none"
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else (
        f"{n >> 10}k" if n >= 1 << 10 and n % (1 << 10) == 0 else str(n))


def _why_not(p: BatchPoint) -> str:
    return f" (does NOT fit: {', '.join(over_limits(p))})"


def _sum_label(p: BatchPoint) -> str:
    if p.accumulate_in == "host":
        return f", {p.accumulate} sum in host memory"
    if p.accumulate_in == "host-stack":
        return ", gradients kept in host memory"
    if p.accumulate_in == "device-fused":
        return (f", {p.accumulate} sum (the blocks' in their weights' dtype, made in the "
                "backward scan)")
    return "" if p.accumulate == "float32" else f", {p.accumulate} sum"


def batch_point_from_record(record: dict[str, Any]) -> BatchPoint:
    """The `BatchPoint` of a `row_record`'s `"low"` or `"high"`; a point recorded
    before its run settings were gets them as `Plan.run_settings()` gives them with
    JAX's and XLA's defaults."""
    values: dict[str, Any] = dict(record, shape=LlamaShape(**record["shape"]))
    values["run_settings"] = tuple(record["run_settings"])
    return BatchPoint(**values)


def batch_table(rows: Sequence[BatchRow]) -> str:
    """A Markdown table of `batch_row`s: per GPU and mode, the plan at `2k`
    micro-batches (a loop of one is not a loop in XLA's plan) and the smallest global
    batch within 10%."""
    lines = [
        "| GPU | mode | model | tokens per step | device peak | host | to device / to host "
        "per step | compute floor (s) | transfer floor (s) | ratio | smallest batch within "
        "10% | run with |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        p = r.high
        gpu = p.target.upper() + ("" if p.n_devices == 1 else f" x {p.n_devices}")
        if r.compute_s is None:
            error = (r.low.error or p.error or "")[:120].replace("|", "/").replace("\n", " ")
            lines.append(f"| {gpu} | {p.mode} | {p.shape.name} | {_tokens(p.tokens)} "
                         f"| | | | | | | XLA: {error} | |")
            continue
        ratio = p.transfer_floor_s / p.compute_floor_s if p.compute_floor_s else math.inf
        lines.append(
            f"| {gpu} | {p.mode}{_sum_label(p)} "
            f"| {p.shape.name}{'' if p.fits else _why_not(p)} "
            f"| {_tokens(p.tokens)} | {size_text(p.device_peak_bytes)} | {size_text(p.host_bytes)} "
            f"| {size_text(p.bytes_to_device)} / {size_text(p.bytes_to_host)} "
            f"| {p.compute_floor_s:.3f} | {p.transfer_floor_s:.3f} | {ratio:.2f} "
            f"| {_tokens(r.smallest)} | {settings_text(p.run_settings) if p.fits else ''} |")
    return "\n".join(lines)


def row_record(r: BatchRow) -> dict[str, Any]:
    """A `BatchRow` as plain data (JSON)."""
    return {"low": dataclasses.asdict(r.low), "high": dataclasses.asdict(r.high),
            "compute_s": None if r.compute_s is None else dataclasses.asdict(r.compute_s),
            "transfer_s": None if r.transfer_s is None else dataclasses.asdict(r.transfer_s),
            "smallest_tokens": r.smallest}


def _models(args: Any, gpus: Sequence[tuple[str, int]], names: Sequence[str],
            search: Callable[..., Any]) -> list[tuple[str, int, str, LlamaShape]]:
    """`(target, devices, mode, shape)`: each GPU and mode's largest model, from
    `--models-from` or a search."""
    if args.models_from:
        with open(args.models_from) as f:
            published = json.load(f)
        return [(r["target"], r["n_devices"], r["mode"], LlamaShape(**r["largest"]["shape"]))
                for r in published if r["largest"] is not None
                and (r["target"], r["n_devices"]) in gpus and r["mode"] in names]
    return [(r.target, r.n_devices, r.mode.name, r.largest.shape)
            for r in search(args, list(gpus), list(names)) if r.largest is not None]


def _progress(p: BatchPoint) -> None:
    print(f"  {p.target}{'' if p.n_devices == 1 else f' x {p.n_devices}'} {p.mode:13s} "
          f"{p.shape.name:32s} {p.micro_batches:3d} micro-batches  device "
          f"{size_text(p.device_peak_bytes):>10s}  to device {size_text(p.bytes_to_device):>10s}  "
          f"{'fits' if p.fits else 'does not fit'}  [{p.plan_s:.0f} s]", file=sys.stderr,
          flush=True)


def run_batch(args: Any, gpus: Sequence[tuple[str, int]], names: Sequence[str],
              search: Callable[..., Any], mesh_of: Callable[[int], Any]) -> int:
    """`capacity_run.py --micro-batches K`: the batch table."""

    device_memory = None if args.device_memory is None else int(args.device_memory * (1 << 20))
    rows = []
    for target, n, mode, shape in _models(args, gpus, names, search):
        shape = dataclasses.replace(shape, batch=args.micro_batch,
                                    seq=args.seq_len or shape.seq)
        rows.append(batch_row(shape, MODES_BY_NAME[mode], args.micro_batches, target,
                              int(args.host_memory * GB) * n, mesh_of(n), device_memory,
                              _progress, args.accumulate,
                              getattr(args, "accumulate_in", "device")))
    table = batch_table(rows)
    print(table)
    print(f"\nXLA's plan (compiled without a GPU, not a measurement) of the optimizer step "
          f"that scans {args.micro_batches} micro-batches and updates once, per GPU and mode; "
          f"the smallest batch is extrapolated from the plans at {args.micro_batches} and "
          f"{2 * args.micro_batches} micro-batches (a line in the micro-batches: matrix-product "
          "flops at the peak rate; the larger direction of the copies at 64 GB/s).")
    write_outputs(args.markdown, args.json, table, [row_record(r) for r in rows])
    return 0


def formula_table(published: Sequence[dict[str, Any]], limit: float = 0.1) -> str:
    """A Markdown table of the smallest global batch by formula alone, from the
    one-micro-batch plans of a capacity JSON (`capacity_run.py --json`): the compute
    floor grows with the micro-batches, the transfer floor does not where the weights
    stay on the device (every copy is the state's, once per optimizer step); where the
    blocks' weights wait in host memory (`+params`, `+activations`) every copy is taken
    as per micro-batch. Not planned: the accumulating step's device peak is not known
    here (it adds the gradient sum, 4 bytes a parameter over the devices)."""

    lines = ["| GPU | mode | model | tokens per micro-batch | compute floor per micro-batch (s) "
             "| transfer floor (s) | smallest batch within 10% (formula) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in published:
        p = r["largest"]
        if p is None:
            continue
        shape = LlamaShape(**p["shape"])
        per_micro = shape.batch * shape.seq * r["n_devices"]
        each = MODES_BY_NAME[r["mode"]].params_on_host
        compute = Line(0.0, p["compute_floor_s"])
        transfer = Line(0.0, p["transfer_floor_s"]) if each else Line(p["transfer_floor_s"], 0.0)
        gpu = r["target"].upper() + ("" if r["n_devices"] == 1 else f" x {r['n_devices']}")
        lines.append(f"| {gpu} | {r['mode']} | {shape.name} | {_tokens(per_micro)} "
                     f"| {p['compute_floor_s']:.3f} | {p['transfer_floor_s']:.3f}"
                     f"{' per micro-batch' if each else ''} "
                     f"| {_tokens(smallest_batch(per_micro, compute, transfer, limit))} |")
    return "\n".join(lines)

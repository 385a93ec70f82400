"""The capacity table for one TPU v5e and its host: for each mode, the largest decoder
(the project's Llama at width 2048, seq 1024, batch 4: `harness.llama_shape`, as
`bench/train.py` trains it) whose step *and* start-up fit
the chip, with the host's memory shared with the TPU runtime. Planned from shapes:
the step by `eqx_offload.plan`, the start-up (`filter_make`) by
`eqx_offload.planner.plan_startup`, both for `"v5e"`, compiled without a chip.

    python bench/capacity_host.py [--host-memory GB ...] [--runtime GB] [--modes ...]
                                  [--max-layers N] [--json PATH]

A row fits when the step's and the start-up's device peaks are within the v5e's HBM and
the host bytes (the larger of the step's and the start-up's, plus the runtime's share)
within the host's memory. The 8-bit row is planned from bytes (see `eight_bit`).
"""

import argparse
import json
import os
import sys
from typing import Any, Optional

import jax

import eqx_offload

sys.path.insert(0, os.path.dirname(__file__))
from capacity import largest_fitting, size_text  # (bench/)
from harness import llama_shape, mode_of, step_of, trainer


GB = 10**9
MODES = ("fp32", "state", "+master", "+activations", "+activations-bf16state")


def _abstract_key() -> jax.ShapeDtypeStruct:
    key = jax.random.key(0)
    return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=key.sharding)


def plan_row(name: str, layers: int, host_memory: int, runtime: int,
             width: int = 2048) -> dict[str, Any]:
    """The step's and the start-up's v5e plans of one size in one mode."""
    shape = llama_shape(width, layers)
    start, grad_step = trainer(shape, name)
    key = _abstract_key()
    model, state = eqx_offload.checkpoint.filter_eval_shape(start, key)
    tokens = jax.ShapeDtypeStruct((shape.batch, shape.seq + 1), jax.numpy.int32,
                                  sharding=key.sharding)
    row: dict[str, Any] = {"mode": name, "layers": layers, "params": shape.params,
                           "host_memory": host_memory, "runtime": runtime}
    try:
        step = eqx_offload.plan(step_of(grad_step), model, state, tokens, target="v5e")
        startup = eqx_offload.planner.plan_startup(start, key, target="v5e",
                                                   runtime_host_memory=runtime)
    except eqx_offload.errors.PlanError as error:
        row.update(fits=False, error=str(error)[:300], bound="device")
        return row
    host = max(step.host_total_bytes, startup.host_peak_bytes)
    device = max(step.device_peak_bytes, startup.device_peak_bytes)
    row.update(step_device=step.device_peak_bytes, startup_device=startup.device_peak_bytes,
               device_memory=step.device_memory_size, host_arrays=startup.host_array_bytes,
               host=host, host_per_param=startup.host_array_bytes / shape.params,
               fits=device <= step.device_memory_size and host + runtime <= host_memory,
               bound=("host" if host + runtime > host_memory else
                      "device" if device > step.device_memory_size else None))
    return row


def largest(name: str, host_memory: int, runtime: int, max_layers: int,
            progress: bool = True) -> tuple[Optional[dict[str, Any]], Optional[dict[str, Any]]]:
    """The largest fitting row of `name` (by bisection over the layers) and the first
    that does not fit."""
    rows: dict[int, dict[str, Any]] = {}

    def fits(layers: int) -> bool:
        rows[layers] = plan_row(name, layers, host_memory, runtime)
        if progress:
            print(json.dumps(rows[layers]), file=sys.stderr, flush=True)
        return bool(rows[layers]["fits"])

    sizes = list(range(1, max_layers + 1))
    index, _ = largest_fitting(sizes, fits)
    best = None if index is None else rows[sizes[index]]
    above = min((n for n in rows if best is None or n > best["layers"]), default=None)
    return best, None if above is None else rows[above]


def host_arrays(name: str, layers: int, width: int = 2048) -> tuple[int, int]:
    """`(host, device)`: the bytes of the model and state `trainer` makes in each
    memory (exact, from shapes: `filter_eval_shape`)."""
    start, _ = trainer(llama_shape(width, layers), name)
    out = eqx_offload.checkpoint.filter_eval_shape(start, _abstract_key())
    host = device = 0
    for x in jax.tree.leaves(out):
        n = x.size * x.dtype.itemsize
        if x.sharding.memory_kind == "pinned_host":
            host += n
        else:
            device += n
    return host, device


def step_host_extra(name: str, layers: int, width: int = 2048) -> int:
    """The host bytes a step holds beyond the arrays (from bytes; `plan_row` checks it):
    with the blocks' weights in host memory, their gradients wait there for the update
    (2 bytes a block parameter in bf16); with the layer inputs offloaded, each layer's
    input waits there for the backward pass (bf16). XLA's v5e plan of `+activations` at
    30 layers holds 3.59 GB beyond the arrays; this says 3.58."""
    mode = mode_of(name).mode
    shape = llama_shape(width, layers)
    grads = 2 * shape.block_params * layers if mode.params_on_host else 0
    inputs = (layers * shape.batch * shape.seq * width * 2 if mode.activations_on_host else 0)
    return grads + inputs


def from_bytes(name: str, host_memory: int, runtime: int, max_layers: int,
               eight_bit: bool = False, block: int = 256) -> dict[str, Any]:
    """The largest depth whose arrays and step's host bytes (`step_host_extra`) fit
    `host_memory` beside the runtime's share: the host's bound, from bytes. The arrays
    grow by the same leaves with each layer, so two depths give them at every depth.
    `eight_bit`: AdamW's two moments in 8 bits (block-wise, one fp32 scale per `block`
    values) in place of fp32 ones, the master weights kept in fp32: 2 x (4 - 1) bytes a
    parameter less, 2 x 4 / `block` more."""
    one, two = host_arrays(name, 1)[0], host_arrays(name, 2)[0]
    best: dict[str, Any] = {}
    for layers in range(1, max_layers + 1):
        params = llama_shape(2048, layers).params
        arrays = one + (two - one) * (layers - 1)
        if eight_bit:
            arrays = int(arrays - params * (6 - 8 / block))
        host = arrays + step_host_extra(name, layers)
        if host + runtime > host_memory:
            break
        best = {"layers": layers, "params": params, "host_per_param": arrays / params,
                "step_host_per_param": host / params, "host": host}
    return best


def table(rows: list[tuple[int, str, Optional[dict[str, Any]], Optional[dict[str, Any]]]]) -> str:
    lines = ["| host | mode | largest planned | params | host B/param (arrays) | step device peak "
             "| start-up device peak | next size, and what bounds it |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for host, name, best, above in rows:
        why = "" if above is None else (
            f"{above['layers']} layers: " + (above.get("error", "")[:80] or (
                f"host {(above['host'] + above['runtime']) / GB:.1f} GB > {host / GB:.0f} GB"
                if above["bound"] == "host" else
                f"device {size_text(max(above['step_device'], above['startup_device']))}")))
        if best is None:
            lines.append(f"| {host / GB:.0f} GB | {name} | none | | | | | {why} |")
            continue
        lines.append(
            f"| {host / GB:.0f} GB | {name} | {best['layers']} layers | "
            f"{best['params'] / 1e9:.2f}B | {best['host_per_param']:.2f} | "
            f"{size_text(best['step_device'])} | {size_text(best['startup_device'])} | {why} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host-memory", type=float, nargs="+", default=[40.0])
    parser.add_argument("--runtime", type=float, default=14.0)
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--max-layers", type=int, default=96)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for host in args.host_memory:
        for name in args.modes:
            best, above = largest(name, int(host * GB), int(args.runtime * GB), args.max_layers)
            rows.append((int(host * GB), name, best, above))
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"host": h, "mode": n, "largest": b, "next": a} for h, n, b, a in rows],
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

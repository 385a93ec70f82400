"""Which host<->device copies of a decoder-like optimizer step XLA schedules under
compute, without a chip: the step `offloaded(adamw)` over stacked `(layers, d, d)`,
`(layers, d, ffn)` and `(layers, ffn, d)` float32 weights (a Llama block's seven
matrices), compiled for a TPU v5e through libtpu's deviceless compile (`--target tpu`)
or planned for a GPU (`--target h100`/`h200`, `eqx_offload.plan`). Prints one JSON
line: per direction, the copies, how many have a compute instruction scheduled between
their start and their end (`under_compute`) and, for the TPU, how many are in flight
with a copy the other way (`both_ways`) and the most in flight at once (`in_flight`);
for the TPU the schedule's time if only the link cost time (`link_ms`: each direction a
lane of 14 GB/s, compute free; against `link_ms_full_duplex`, the larger direction's
bytes, and `link_ms_serial`, both directions' bytes one after the other); and the
step's memory analysis. For the TPU it also prints `predicted_ms`, the step time of the
calibrated model (`eqx_offload.plan(...).predicted_step_seconds`,
`eqx_offload/_plan/timing.py`; `--no-plan` skips it). `--option NAME=VALUE` adds an XLA
option to those `filter_jit` compiles with; `--host-dtype int8` plans 8-bit state.

`--target chip` runs the step on this machine's TPU instead: the chip's own schedule,
summarised as above, and the median step time (`step_ms`) against the floor and the
schedule's `link_ms`. One process per row (the 8-layer step needs 3.3 GB of host memory
for its state and 1.6 GB of HBM for its weights).

What the options and the update's `lookahead` and group size do to the schedule:
docs/streamed.md, "On a TPU: copies in flight, and both directions at once".

    JAX_PLATFORMS=cpu TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_WORKER_HOSTNAMES=localhost \
        TPU_SKIP_MDS_QUERY=1 python bench/tpu/overlap.py --target tpu
    JAX_PLATFORMS=cpu python bench/tpu/overlap.py --target h100
    python bench/tpu/overlap.py --target chip --lookahead 2 --no-plan   # on a TPU

Except with `--target chip`, a plan of XLA's schedule, not a measurement.
"""

import argparse
import dataclasses
import json
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_offload


_LINE = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][a-z0-9\-]*)\((?P<args>[^)]*)\)")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\](?:\{(?P<layout>[^}]*)\})?")
_QUIET = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier",
          "after-all", "add-dependency", "copy"}  # (a `copy` in the entry moves no kernel's worth)


def _bytes(array: "re.Match[str]") -> int:
    n = 1
    for d in filter(None, array.group("dims").split(",")):
        n *= int(d)
    return n * int(re.sub("[a-z]", "", array.group("dtype")) or 8) // 8


@dataclasses.dataclass
class Transfer:
    """One asynchronous transfer between host (`S(5)`) and device memory in the entry
    computation of XLA:TPU's scheduled HLO: its direction, bytes and the positions of
    its start and its end in the schedule."""

    direction: str
    nbytes: int
    start: int
    done: int = -1


def tpu_transfers(hlo_text: str) -> tuple[list[Transfer], list[int]]:
    """The host<->device transfers of the entry computation, and the positions of its
    compute instructions (fusions, custom calls, ...), in schedule order."""
    entry = hlo_text[hlo_text.index("\nENTRY"):].splitlines()[1:]
    transfers: dict[str, Transfer] = {}
    compute: list[int] = []
    for i, line in enumerate(entry):
        m = _LINE.match(line)
        if m is None:
            continue
        op = m.group("op")
        if op.endswith("-start"):
            arrays = list(_ARRAY.finditer(m.group("type")))
            host = [("S(5)" in (a.group("layout") or "")) for a in arrays]
            if not any(host):
                continue
            result = len(arrays) - 2  # (..., result, context)
            to_host = host[result]
            sizes = [_bytes(a) for a, h in zip(arrays[:result], host) if not h]
            nbytes = max(sizes) if to_host and sizes else _bytes(arrays[result])
            transfers[m.group("name")] = Transfer("to_host" if to_host else "to_device", nbytes, i)
        elif op.endswith("-done"):
            started = m.group("args").split(",")[0].strip().lstrip("%")
            if started in transfers:
                transfers[started].done = i
        elif op not in _QUIET:
            compute.append(i)
    return list(transfers.values()), compute


def link_seconds(transfers: list[Transfer], bandwidth: float) -> float:
    """The update's time if only the link cost time: each direction one lane of
    `bandwidth` bytes/s (full duplex), a transfer queued on its lane when its start is
    reached in schedule order, each end waiting for its transfer; compute is free."""
    events = sorted([(t.start, 0, k) for k, t in enumerate(transfers)]
                    + [(t.done, 1, k) for k, t in enumerate(transfers)])
    clock, lanes, finish = 0.0, {"to_device": 0.0, "to_host": 0.0}, {}
    for _, is_done, k in events:
        t = transfers[k]
        if is_done:
            clock = max(clock, finish[k])
        else:
            finish[k] = lanes[t.direction] = max(clock, lanes[t.direction]) + t.nbytes / bandwidth
    return max([clock, *finish.values()])


def tpu_summary(hlo_text: str, bandwidth: float = 14e9) -> dict[str, Any]:
    """Per direction: transfers, bytes, and how many have a compute instruction between
    start and end (`under_compute`) or a transfer the other way in flight at once
    (`both_ways`)."""
    transfers, compute = tpu_transfers(hlo_text)
    out: dict[str, Any] = {}
    for direction in ("to_device", "to_host"):
        these = [t for t in transfers if t.direction == direction]
        other = [t for t in transfers if t.direction != direction]
        under = [t for t in these if any(t.start < c < t.done for c in compute)]
        both = [t for t in these if any(o.start < t.done and t.start < o.done for o in other)]
        out[direction] = {"copies": len(these), "bytes": sum(t.nbytes for t in these),
                          "under_compute": len(under),
                          "bytes_under_compute": sum(t.nbytes for t in under),
                          "both_ways": len(both), "bytes_both_ways": sum(t.nbytes for t in both)}
    # The most copies each way started and not yet done at one point of the schedule
    # (the probe `duplex_loop.py`: up to 4 each way, both directions run together).
    ends = sorted([(t.start, 1, t.direction) for t in transfers]
                  + [(t.done, -1, t.direction) for t in transfers])
    now = {"to_device": 0, "to_host": 0}
    for direction in now:
        out[direction]["in_flight"] = 0
    for _, step, direction in ends:
        now[direction] += step
        out[direction]["in_flight"] = max(out[direction]["in_flight"], now[direction])
    # The link alone, at `bandwidth` each way: this schedule, against both directions
    # always busy (the larger direction's bytes) and against one direction at a time.
    one_way = max(out[d]["bytes"] for d in out) / bandwidth
    out["link_ms"] = round(1e3 * link_seconds(transfers, bandwidth), 1)
    out["link_ms_full_duplex"] = round(1e3 * one_way, 1)
    out["link_ms_serial"] = round(1e3 * sum(out[d]["bytes"] for d in ("to_device", "to_host")) / bandwidth, 1)
    return out


def params(layers: int, width: int, ffn: int) -> dict[str, jax.ShapeDtypeStruct]:
    d, f, f32 = width, ffn, jnp.float32
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d),
              "gate": (d, f), "up": (d, f), "down": (f, d)}
    return {k: jax.ShapeDtypeStruct((layers, *s), f32) for k, s in shapes.items()}


def step_and_args(args: argparse.Namespace) -> tuple[Any, tuple[Any, ...]]:
    host_dtype = None if args.host_dtype is None else jnp.dtype(args.host_dtype)
    opt = eqx_offload.offloaded(optax.adamw(1e-3), group_bytes=args.group_bytes,
                                lookahead=args.lookahead, host_dtype=host_dtype)
    cpu = NamedSharding(Mesh(jax.devices("cpu")[:1], ("x",)), P())
    p = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu),
                     params(args.layers, args.width, args.ffn))
    state = eqx_offload.checkpoint.abstract_init(opt, p)

    def step(params: Any, state: Any, grads: Any) -> Any:
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return eqx_offload.filter_jit(step, donate="all"), (p, state, p)


def on_tpu(args: tuple[Any, ...]) -> tuple[Any, ...]:
    from jax.experimental import topologies
    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    mesh = Mesh([device], ("x",))

    def move(s: Any) -> Any:
        kind = s.sharding.memory_kind
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P(), memory_kind=kind))

    return jax.tree.map(move, args)


def summary(copies: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for direction in ("to_device", "to_host"):
        these = [c for c in copies if c.direction == direction]
        out[direction] = {"copies": len(these),
                          "under_compute": sum(c.overlapped for c in these),
                          "bytes": sum(c.nbytes * c.count for c in these),
                          "bytes_under_compute": sum(c.nbytes * c.count for c in these if c.overlapped)}
    return out


def on_chip(step: Any, step_args: tuple[Any, ...], options: dict[str, str],
            args: argparse.Namespace) -> dict[str, Any]:
    """Run the step on this machine's first device (a TPU): its schedule's summary (as
    `tpu_summary`: the chip's own compile) and the median of `args.reps` steps after the
    first, against the link's floor (`link_ms_full_duplex`) and its schedule's replay."""
    import statistics

    weights = jax.tree.map(lambda s: jnp.full(s.shape, 0.5, s.dtype),
                           params(args.layers, args.width, args.ffn))
    opt = eqx_offload.offloaded(optax.adamw(1e-3), group_bytes=args.group_bytes,
                                lookahead=args.lookahead,
                                host_dtype=None if args.host_dtype is None
                                else jnp.dtype(args.host_dtype))
    state = opt.init(weights)
    grads = jax.jit(lambda p: jax.tree.map(lambda x: x * 1e-3, p))
    compiled = step.lower(weights, state, grads(weights)).compile(options or None)
    result = tpu_summary(compiled.as_text())
    times = []
    for _ in range(args.reps + 1):
        g = jax.block_until_ready(grads(weights))
        start = time.perf_counter()
        weights, state = jax.block_until_ready(compiled(weights, state, g))
        times.append(time.perf_counter() - start)
    ms = 1e3 * statistics.median(times[1:])
    floor, replay = result["link_ms_full_duplex"], result["link_ms"]  # (0 on a CPU)
    result.update(step_ms=round(ms, 1),
                  step_over_floor=round(ms / floor, 3) if floor else None,
                  step_over_replay=round(ms / replay, 3) if replay else None,
                  first_step_s=round(times[0], 2), device=str(jax.devices()[0].device_kind))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tpu", help="tpu, h100 or h200")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--group-bytes", default="auto",
                        type=lambda s: s if s in ("auto", "None") else int(s))
    parser.add_argument("--lookahead", type=int, default=1)
    parser.add_argument("--host-dtype", help="offloaded's host_dtype (int8: 8-bit state)")
    parser.add_argument("--option", action="append", default=[],
                        help="an XLA compiler option, NAME=VALUE (repeatable)")
    parser.add_argument("--dump", help="write the scheduled HLO (TPU) to this file")
    parser.add_argument("--no-plan", action="store_true",
                        help="(tpu) skip `eqx_offload.plan`'s compile and its predicted_ms")
    parser.add_argument("--reps", type=int, default=6, help="(chip) timed steps, after one")
    args = parser.parse_args()
    if args.group_bytes == "None":
        args.group_bytes = None
    options = {k: v for k, v in (o.split("=", 1) for o in args.option)}
    step, step_args = step_and_args(args)  # (chip: shapes only; `on_chip` makes arrays)
    start = time.perf_counter()
    if args.target == "chip":
        result = on_chip(step, step_args, options, args)
    elif args.target == "tpu":
        compiled = step.lower_for(("tpu",), on_tpu(step_args), {}).compile(options or None)
        text = compiled.as_text()
        if args.dump:
            with open(args.dump, "w") as f:
                f.write(text)
        result = tpu_summary(text)
        memory = compiled.memory_analysis()
        if not args.no_plan:
            planned = eqx_offload.plan(step, *step_args, target="v5e",
                                       compiler_options=options or None)
            result["predicted_ms"] = round(1e3 * (planned.predicted_step_seconds or 0.0), 1)
        result.update({"temp_bytes": memory.temp_size_in_bytes,
                       "argument_bytes": memory.argument_size_in_bytes,
                       "host_temp_bytes": memory.host_temp_size_in_bytes})
    else:
        plan = eqx_offload.plan(step, *step_args, target=args.target,
                                    compiler_options=options or None)
        result = {"device_peak_bytes": plan.device_peak_bytes, "temp_bytes": plan.temp_bytes}
        result.update(summary(plan.copies))
    result.update(target=args.target, jax=jax.__version__, seconds=round(time.perf_counter() - start, 1),
                  layers=args.layers, width=args.width, ffn=args.ffn,
                  group_bytes=args.group_bytes, lookahead=args.lookahead, options=options,
                  host_dtype=args.host_dtype,
                  env=os.environ.get("TPU_ACCELERATOR_TYPE"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

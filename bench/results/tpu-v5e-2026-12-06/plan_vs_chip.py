"""The TPU plan of the benchmark's steps against what the chip recorded.

- The MLP of `bench/results/tpu-v5e-2026-12-05/bench.json` (AdamW, batch 512) in each
  of its modes: each field of XLA's memory analysis beside the chip's (the table of
  docs/gpu-plan.md, "On a TPU"):

      JAX_PLATFORMS=cpu python bench/tpu/plan_vs_chip.py [bench.json]

- The project's Llama (`bench/llama.py`, d=2048, seq 1024, batch 4) in the rows of
  issue 56's table, measured on a v5e on 2026-12-06: the plan's bytes moved, device
  peak and host bytes, and the step time the plan predicts (`Plan.predicted_step_seconds`)
  beside the chip's. One row per process (a 24-layer plan takes minutes and ~3 GB):

      JAX_PLATFORMS=cpu python bench/tpu/plan_vs_chip.py --llama ROW

  ROW is one of `LLAMA_ROWS`. Prints one JSON line.

Every number of the plan is XLA:TPU's plan (compiled without a TPU), not a measurement.
"""

import argparse
import functools
import json
import pathlib
import sys
import time
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_offload
from eqx_offload.cli.models import make_step, mse_loss


RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results" / "tpu-v5e-2026-12-05"
FIELDS = ("argument_size_in_bytes", "temp_size_in_bytes", "output_size_in_bytes",
          "alias_size_in_bytes", "host_argument_size_in_bytes", "host_temp_size_in_bytes")
MODES = {
    "baseline": lambda adamw: adamw,
    "eqx_offload": eqx_offload.offloaded,
    "host_bf16": lambda adamw: eqx_offload.offloaded(adamw, host_dtype=jnp.bfloat16),
}


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def plan_point(mode: str, width: int, depth: int, batch: int) -> eqx_offload.planner.Plan:
    """The v5e plan of the benchmark's step in `mode`, from shapes."""
    on_cpu = jax.sharding.make_single_device_sharding(jax.devices()[0])
    model = eqx.filter_eval_shape(lambda: eqx.nn.MLP(width, width, width, depth,
                                                     key=jax.random.key(0)))
    model = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_cpu)
                         if _is_leaf(x) else x, model)
    optimizer = MODES[mode](optax.adam(1e-3))
    state = eqx_offload.checkpoint.abstract_init(optimizer, eqx.filter(model, _is_leaf))
    data = jax.ShapeDtypeStruct((batch, width), jnp.float32, sharding=on_cpu)
    step = eqx_offload.filter_jit(make_step(optimizer, mse_loss), donate="all")
    return eqx_offload.plan(step, model, state, (data, data), target="v5e")


# The rows of issue 56's table (chip: TPU v5e, main 9b14360, JAX 0.10.2, 2026-12-06,
# ../shared/tpu-results/2026-12-06/): (capacity mode, layers, bf16 state in host memory,
# `group_bytes` of the state's `offloaded`, the chip's step in seconds, `None` for a row
# not yet measured: `bench/tpu/capacity_chip.py MODE 2048 LAYERS` measures it).
LLAMA_ROWS: dict[str, tuple[str, int, bool, Any, Optional[float]]] = {
    "plain-8": ("fp32", 8, False, "auto", 0.1754),
    "state-8": ("state", 8, False, "auto", 0.5641),
    "state-24": ("state", 24, False, "auto", 1.62),
    "activations-8": ("+activations", 8, False, 0, 2.71),
    "activations-20": ("+activations", 20, False, "auto", 6.56),
    "activations-bf16state-20": ("+activations", 20, True, "auto", 5.71),
    "state-16": ("state", 16, False, "auto", None),
    "activations-bf16state-12": ("+activations", 12, True, "auto", None),
}


def llama_step(row: str) -> tuple[Any, tuple[Any, ...]]:
    """The step of a row of `LLAMA_ROWS` (as `bench/tpu/capacity_chip.py` runs it) and
    its abstract arguments."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import capacity  # (bench/)
    from tpu.capacity_chip import shape_of

    name, layers, bf16_state, group_bytes, _ = LLAMA_ROWS[row]
    mode = capacity.MODES_BY_NAME[name]
    shape = shape_of(2048, layers, 1024, 4)
    adamw = optax.adamw(3e-4, weight_decay=0.1)
    offload = functools.partial(eqx_offload.offloaded, group_bytes=group_bytes,
                                host_dtype=jnp.bfloat16 if bf16_state else None)
    if not mode.bf16:
        update, model, state = capacity.training_update(shape, mode)
        if mode.state_on_host:  # (`training_update` offloads with the defaults)
            opt = offload(adamw)
            state = eqx_offload.checkpoint.filter_eval_shape(
                lambda m: opt.init(eqx.filter(m, eqx.is_array)), model)
            update = capacity._optimizer_update(opt)
        return capacity._one_step(update), (model, state, capacity.abstract_tokens(shape, None))

    def make() -> Any:
        model = capacity.Llama(shape, jax.random.key(0), offload_input=mode.activations_on_host)
        return capacity._blocks_to_host(model) if mode.params_on_host else model

    model = eqx_offload.checkpoint.filter_eval_shape(make)
    mw = eqx_offload.master_weights(adamw, offload=offload)
    model, state = eqx_offload.checkpoint.filter_eval_shape(mw.init, model)
    return (capacity._one_step(capacity._master_update(mw)),
            (model, state, capacity.abstract_tokens(shape, None)))


def llama_row(row: str) -> dict[str, Any]:
    """Plan a row of `LLAMA_ROWS` for a v5e: what it moves and holds, and the step time
    the plan predicts beside the chip's. (Its `--hlo FILE` option, which patched a
    private function of the package to keep the scheduled HLO, is not kept.)"""
    start = time.perf_counter()
    step, args = llama_step(row)
    planned = eqx_offload.plan(step, *args, target="v5e")
    measured = LLAMA_ROWS[row][-1]
    predicted = planned.predicted_step_seconds
    return {"row": row, "measured_s": measured,
            "predicted_s": None if predicted is None else round(predicted, 4),
            "error": None if predicted is None or measured is None else round(
                predicted / measured - 1, 3),
            "to_device_GB": planned.bytes_moved("to_device") / 1e9,
            "to_host_GB": planned.bytes_moved("to_host") / 1e9,
            "device_peak_GB": planned.device_peak_bytes / 1e9,
            "host_GB": planned.host_bytes / 1e9,
            "host_argument_GB": planned.host_argument_bytes / 1e9,
            "host_temp_GB": planned.host_temp_bytes / 1e9,
            "unaliased_host_output_GB": planned.unaliased_host_output_bytes / 1e9,
            "compute_floor_s": planned.compute_floor_seconds,
            "transfer_floor_s": planned.transfer_floor_seconds,
            "matmul_flops": dict(planned.matmul_flops),
            "plan_s": round(time.perf_counter() - start, 1), "jax": jax.__version__,
            "summary": planned.summary()}


def main(path: str) -> None:
    recorded = json.loads(pathlib.Path(path).read_text())
    print(f"chip: {recorded['machine']['device_kind']}, JAX {recorded['machine']['jax_version']}, "
          f"{recorded['machine']['date']}; plan: JAX {jax.__version__}, without a TPU")
    for point in recorded["points"]:
        if point["mode"] not in MODES or not point.get("memory_analysis"):
            continue
        shape = point["shape"]
        planned = plan_point(point["mode"], shape["width"], shape["depth"], shape["batch"])
        chip = point["memory_analysis"]
        plan = {"argument_size_in_bytes": planned.argument_bytes,
                "temp_size_in_bytes": planned.temp_bytes,
                "output_size_in_bytes": planned.output_bytes,
                "alias_size_in_bytes": planned.alias_bytes}
        print(f"{point['mode']} ({point['params'] / 1e6:.0f}M): device peak "
              f"{planned.device_peak_bytes / 2**20:.1f} MiB, host {planned.host_bytes} B "
              f"(chip: host arguments {chip['host_argument_size_in_bytes']} B)")
        for field, value in plan.items():
            same = "=" if value == chip[field] else f"chip {chip[field]:,}"
            print(f"  {field:24s} {value:>16,}  {same}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", nargs="?", default=str(RESULTS / "bench.json"))
    parser.add_argument("--llama", choices=sorted(LLAMA_ROWS), help="plan this Llama row")
    options = parser.parse_args()
    if options.llama:
        print(json.dumps(llama_row(options.llama)), flush=True)
    else:
        main(options.bench_json)

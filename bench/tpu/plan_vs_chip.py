"""The TPU plan of the benchmark's steps against what the chip recorded: plans the MLP
of `bench/results/tpu-v5e-2026-12-05/bench.json` (AdamW, batch 512) for a v5e in each
of its modes, from shapes on a machine without a TPU, and prints each field of XLA's
memory analysis beside the chip's (the table of docs/gpu-plan.md, "On a TPU"):

    JAX_PLATFORMS=cpu python bench/tpu/plan_vs_chip.py [bench.json]
"""

import json
import pathlib
import sys
from typing import Any

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
    on_cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    model = eqx.filter_eval_shape(lambda: eqx.nn.MLP(width, width, width, depth,
                                                     key=jax.random.key(0)))
    model = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_cpu)
                         if _is_leaf(x) else x, model)
    optimizer = MODES[mode](optax.adam(1e-3))
    state = eqx_offload.checkpoint.abstract_init(optimizer, eqx.filter(model, _is_leaf))
    data = jax.ShapeDtypeStruct((batch, width), jnp.float32, sharding=on_cpu)
    step = eqx_offload.filter_jit(make_step(optimizer, mse_loss), donate="all")
    return eqx_offload.plan(step, model, state, (data, data), target="v5e")


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
    main(sys.argv[1] if len(sys.argv) > 1 else str(RESULTS / "bench.json"))

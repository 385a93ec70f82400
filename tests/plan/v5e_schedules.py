"""Record the v5e schedule of one row of `bench/train.py` for `test_timing.py`: plans the
row for a v5e without one (libtpu) and appends what the time model reads of the plan
(its copies, its kernels and its host bytes) with the step the chip took to
`v5e_schedules.json`, so that the suite replays big steps without compiling them.

    JAX_PLATFORMS=cpu TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_WORKER_HOSTNAMES=localhost \\
        TPU_SKIP_MDS_QUERY=1 PYTHONPATH=. python tests/plan/v5e_schedules.py \\
        MODE WIDTH LAYERS SEQ BATCH MICRO MEASURED_SECONDS SOURCE
"""

import json
import pathlib
import sys
from typing import Any

RECORDS = pathlib.Path(__file__).with_name("v5e_schedules.json")


def compact(plan: Any) -> dict[str, Any]:
    """What `timing.predict_seconds` reads of a plan, computations named by number."""
    names: dict[str, int] = {}

    def number(name: str) -> int:
        return names.setdefault(name, len(names))

    return {
        "host_temp_bytes": plan.host_temp_bytes,
        "unaliased_host_output_bytes": plan.unaliased_host_output_bytes,
        "compute_floor_seconds": plan.compute_floor_seconds,
        "copies": [[c.direction, c.nbytes, c.count, number(c.computation), c.start, c.done]
                   for c in plan.copies],
        "kernels": [[number(k.computation), k.position, k.cycles, [number(c) for c in k.calls],
                     k.trips] for k in plan.kernels],
    }


def write(records: dict[str, Any]) -> None:
    """`records` into `RECORDS`, a row a line."""
    RECORDS.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}"
                                          for k, v in sorted(records.items())) + "\n}\n")


def main(argv: list[str]) -> None:
    import jax

    import eqx_offload

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    import harness  # (bench/)

    mode, measured, source = argv[0], float(argv[6]), argv[7]
    width, layers, seq, batch, micro = map(int, argv[1:6])
    shape = harness.llama_shape(width, layers, seq, batch)
    start, grad_step = harness.trainer(shape, mode)
    model, state = eqx_offload.checkpoint.filter_eval_shape(start, jax.random.key(0))
    tokens = jax.eval_shape(lambda: harness.tokens_of(shape, micro))
    tokens = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=(
        jax.sharding.SingleDeviceSharding(jax.devices()[0])))
    plan = eqx_offload.plan(harness.step_of(grad_step, micro), model, state, tokens,
                            target="v5e")
    records = json.loads(RECORDS.read_text()) if RECORDS.exists() else {}
    name = f"{mode} d{width}x{layers} {seq}x{batch}x{micro}"
    records[name] = {"measured_seconds": measured, "source": source, "jax": jax.__version__,
                     "predicted_seconds": plan.predicted_step_seconds, **compact(plan)}
    write(records)
    print(name, plan.predicted_step_seconds, measured)


if __name__ == "__main__":
    main(sys.argv[1:])

"""One process of `tests/test_multiprocess.py`, and the training it is compared with.

    python tests/mp_worker.py --process-id 0 --num-processes 2 --port 12345 --out /tmp/out.npz
    python tests/mp_worker.py --process-id 1 --num-processes 2 --port 12345

Each process sets up two CPU devices before the backend starts, joins JAX's distributed
runtime (gloo collectives), and trains on a global 2x2 mesh with
`offloaded(optax.adamw(...))` under `eqx_offload.filter_jit(donate="all")`; process 0
writes the gathered result.
"""

import argparse
import sys
from typing import Any

import numpy as np


DIM = 8
BATCH = 8
STEPS = 3
SPECS = {"w1": (None, "model"), "b1": ("model",), "w2": ("model", None), "b2": ()}


def initial_values() -> tuple[dict[str, np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
    """Parameters and batches as NumPy arrays, the same in every process."""
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.standard_normal((DIM, DIM), np.float32) / 3,
        "b1": rng.standard_normal((DIM,), np.float32) / 3,
        "w2": rng.standard_normal((DIM, DIM), np.float32) / 3,
        "b2": rng.standard_normal((DIM,), np.float32) / 3,
    }
    data = [
        (rng.standard_normal((BATCH, DIM), np.float32), rng.standard_normal((BATCH, DIM), np.float32))
        for _ in range(STEPS)
    ]
    return params, data


def train() -> dict[str, np.ndarray]:
    """Trains on a 2x2 ("data", "model") mesh over all processes' devices; returns the
    final params, state leaves and losses as NumPy arrays, and where the state lived."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    import eqx_offload

    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])

    def global_array(value: np.ndarray, spec: tuple[Any, ...]) -> jax.Array:
        sharding = NamedSharding(mesh, P(*spec))
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    values, data = initial_values()
    params = {k: global_array(v, SPECS[k]) for k, v in values.items()}
    opt = eqx_offload.offloaded(optax.adamw(1e-2))
    state = opt.init(params)

    def loss(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    @eqx_offload.filter_jit(donate="all")
    def step(p: Any, s: Any, x: jax.Array, y: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    losses = []
    kinds = set()
    for x, y in data:
        params, state, value = step(params, state, global_array(x, ("data", None)), global_array(y, ("data", None)))
        losses.append(value)
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            kinds.add((jax.tree_util.keystr(path), leaf.sharding.memory_kind, str(leaf.sharding.spec)))
    result = {
        jax.tree_util.keystr(path): np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        for path, leaf in jax.tree_util.tree_flatten_with_path((params, state.inner_state, losses))[0]
    }
    result["__kinds__"] = np.array(sorted(" ".join(k) for k in kinds))
    result["__num_devices__"] = np.array(len(jax.devices()))
    result["__num_processes__"] = np.array(jax.process_count())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2, help="CPU devices in this process")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", default=None, help="where process 0 writes the result (.npz)")
    args = parser.parse_args()

    import jax

    # Both must be set before the CPU backend starts.
    jax.config.update("jax_num_cpu_devices", args.devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=60,
        )
    result = train()
    if args.process_id == 0 and args.out is not None:
        np.savez(args.out, **result)
    if args.num_processes > 1:
        jax.distributed.shutdown()
    print(f"process {args.process_id}: done", file=sys.stderr)


if __name__ == "__main__":
    main()

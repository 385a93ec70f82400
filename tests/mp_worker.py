"""One process of `tests/test_multiprocess.py` (two CPU devices, gloo collectives, a global
2x2 mesh), and the training it is compared with:

    python tests/mp_worker.py 0 12345 out.npz & python tests/mp_worker.py 1 12345
"""

import sys
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_offload


DIM, BATCH, STEPS = 8, 8, 3
SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def initial_values() -> tuple[dict[str, np.ndarray], list[tuple[np.ndarray, ...]]]:
    """Parameters and batches as NumPy arrays, the same in every process."""
    rng = np.random.default_rng(0)
    shapes = {"w1": (DIM, DIM), "b1": (DIM,), "w2": (DIM, DIM), "b2": (DIM,)}
    params = {k: rng.standard_normal(s, np.float32) / 3 for k, s in shapes.items()}
    data = [tuple(rng.standard_normal((BATCH, DIM), np.float32) for _ in "xy")
            for _ in range(STEPS)]
    return params, data


def make_step(opt: optax.GradientTransformation) -> Any:
    """A donated training step of the MLP of `initial_values`' parameters."""
    def loss(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)

    @eqx_offload.filter_jit(donate="all")
    def step(p: Any, s: Any, x: jax.Array, y: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    return step


def train() -> dict[str, np.ndarray]:
    """Trains on a 2x2 ("data", "model") mesh over all processes' devices; returns the
    final params, state leaves and losses as NumPy arrays, and where the state lived."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])

    def global_array(value: np.ndarray, spec: P) -> jax.Array:
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    values, data = initial_values()
    params = {k: global_array(v, SPECS[k]) for k, v in values.items()}
    opt = eqx_offload.offloaded(optax.adamw(1e-2))
    state, step = opt.init(params), make_step(opt)
    losses, kinds = [], set()
    for batch in data:
        x, y = (global_array(v, P("data", None)) for v in batch)
        params, state, value = step(params, state, x, y)
        losses.append(value)
        for path, leaf in jtu.tree_flatten_with_path(state)[0]:
            kinds.add(f"{jtu.keystr(path)} {leaf.sharding.memory_kind} {leaf.sharding.spec}")
    leaves = jtu.tree_flatten_with_path((params, state.inner_state, losses))[0]
    result = {jtu.keystr(path): np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
              for path, leaf in leaves}
    result["__kinds__"] = np.array(sorted(kinds))
    result["__num_devices__"] = np.array(len(jax.devices()))
    result["__num_processes__"] = np.array(jax.process_count())
    return result


def main(process_id: int, port: int, out: str = "") -> None:
    """One of two processes on 127.0.0.1:`port`; process 0 writes the result to `out`."""
    jax.config.update("jax_num_cpu_devices", 2)  # both before the CPU backend starts
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=60)
    result = train()
    if out:
        np.savez(out, **result)
    jax.distributed.shutdown()
    print(f"process {process_id}: done", file=sys.stderr)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])

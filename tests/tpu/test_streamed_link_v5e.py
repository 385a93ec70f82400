"""The streamed update's copies as XLA:TPU schedules them for a v5e (without one): the
pieces of a stack's leaves, taking turns, let a group's fetch and the previous group's
write cross the host link at once."""

from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_offload
from eqx_offload._plan import timing


pytestmark = pytest.mark.both  # (libtpu pins its JAX: both environments)


def test_stacked_pieces_cross_the_link_both_ways_at_once(tpu: Any) -> None:
    """Three stacked fp32 leaves (a block's matrices, 8 layers), AdamW, groups of 4 MiB
    (pieces of 1 or 2 layers): the schedule's copies, replayed as the time model replays
    them, take at most 1.25x one direction's bytes at 14 GB/s. One leaf's pieces after
    another took 1.53x: each write waited for the next piece's read of the same buffer."""
    cpu = NamedSharding(Mesh(jax.devices("cpu")[:1], ("x",)), P())
    shapes = {"a": (8, 512, 512), "b": (8, 512, 1024), "c": (8, 1024, 512)}
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=cpu) for k, s in shapes.items()}
    opt = eqx_offload.offloaded(optax.adamw(1e-3), group_bytes=4 << 20)
    state = eqx_offload.checkpoint.abstract_init(opt, params)

    def step(params: Any, state: Any, grads: Any) -> Any:
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    planned = eqx_offload.plan(eqx_offload.filter_jit(step, donate="all"), params, state,
                               params, target="v5e")
    one_way = max(planned.bytes_moved(d) for d in ("to_device", "to_host")) / 14e9
    assert planned.bytes_moved("to_device") == planned.bytes_moved("to_host") == 2 * sum(
        4 * a * b * c for a, b, c in shapes.values())
    assert 1.0 <= timing.link_seconds(planned) / one_way <= 1.25

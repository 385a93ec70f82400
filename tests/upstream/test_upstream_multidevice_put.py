"""Canary: `jax.device_put` of a multi-device array to other devices or another memory
kind keeps every shard's data, which every move of the package relies on.
jax-ml/jax#36308 lost all but the first device's (fixed by jax-ml/jax#36524); if this
fails, exclude that JAX (`.ci/constraints-*`, the README's range)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P


def _mesh(devices, shape, names):
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), names)


def _check(x: jax.Array, expected: np.ndarray) -> None:
    assert np.array_equal(np.asarray(x), expected)
    for shard in x.addressable_shards:  # every device's own piece, not only the first
        assert np.array_equal(np.asarray(shard.data), expected[shard.index]), shard.device


SPECS = [("x", 1, P("x")), ("xy", 2, P("x", "y")), ("y_rows", 2, P(None, "y"))]


@pytest.mark.parametrize("name,ndim_mesh,spec", SPECS, ids=[s[0] for s in SPECS])
@pytest.mark.parametrize("move", ["memory_kind", "devices", "devices_and_memory_kind", "respec"])
def test_device_put_keeps_every_shard(name: str, ndim_mesh: int, spec: P, move: str) -> None:
    devices = jax.devices()
    shape, names = ((4,), ("x",)) if ndim_mesh == 1 else ((2, 2), ("x", "y"))
    source_mesh = _mesh(devices[:4], shape, names)
    other_mesh = _mesh(devices[4:8], shape, names)
    expected = np.arange(8 * 12, dtype=np.float32).reshape(8, 12) * 1.5 - 7
    x = jax.device_put(expected, NamedSharding(source_mesh, spec))
    _check(x, expected)
    target = {
        "memory_kind": NamedSharding(source_mesh, spec, memory_kind="pinned_host"),
        "devices": NamedSharding(other_mesh, spec),
        "devices_and_memory_kind": NamedSharding(other_mesh, spec, memory_kind="pinned_host"),
        "respec": NamedSharding(source_mesh, P(*reversed(tuple(spec) + (None,) * (2 - len(spec)))),
                                memory_kind="pinned_host"),
    }[move]
    moved = jax.device_put(x, target)
    assert moved.sharding.memory_kind == target.memory_kind
    _check(moved, expected)
    _check(jax.device_put(moved, NamedSharding(source_mesh, spec)), expected)  # and back

"""Canary: JAX 0.12.1 on the CPU cannot copy an array that a compiled program wrote to host
memory: `jax.device_put` of a `jax.jit` output in 'pinned_host' (or 'unpinned_host') to
any other memory or device fails with "UNIMPLEMENTED: Unsupported layout used for PjRt
CPU buffers: {1,0:S(5)} (original) vs. f32[4,64] (canonicalized)"; JAX 0.10.2 and
0.12.0.1 copy it. `compat.device_put`, which every move of the package makes, brings such
arrays through a jitted move (`compat.HOST_OUTPUT_COPY_FAILS`). When the first test fails,
JAX changed it: bound the flag by version again, or drop the shim."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from eqx_offload._core import compat


def _written_to(sharding: jax.sharding.Sharding) -> jax.Array:
    """An array that a compiled program wrote to `sharding`'s memory."""
    return jax.jit(lambda a: a * 2, out_shardings=sharding)(jnp.arange(256.0).reshape(4, 64))


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_a_programs_host_output_copies_except_where_the_flag_says(kind: str) -> None:
    device = jax.devices()[0]
    host = _written_to(compat.single_device_sharding(device, memory_kind=kind))
    assert host.sharding.memory_kind == kind
    try:
        jax.device_put(host, compat.single_device_sharding(device))
    except jax.errors.JaxRuntimeError as error:
        assert "Unsupported layout used for PjRt CPU buffers" in str(error), error
        copied = False
    else:
        copied = True
    assert copied != compat.HOST_OUTPUT_COPY_FAILS
    # What `device_put` puts in host memory copies on every JAX: only program outputs fail.
    put = jax.device_put(jnp.ones(3), compat.single_device_sharding(device, memory_kind=kind))
    assert jax.device_put(put, compat.single_device_sharding(device)).sharding.memory_kind == "device"


def _mesh_sharding(kind: str) -> jax.sharding.Sharding:
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("x",))
    return NamedSharding(mesh, P("x"), memory_kind=kind)


TARGETS = {
    "device": lambda s: s.with_memory_kind("device"),
    "unpinned_host": lambda s: s.with_memory_kind("unpinned_host"),
    "other_device": lambda s: compat.single_device_sharding(jax.devices()[3]),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("source", ["one_device", "mesh"])
def test_device_put_brings_a_programs_host_output(source: str, target: str) -> None:
    """`compat.device_put` moves program outputs in host memory, beside an array that is
    already in device memory, to where they are sent, bitwise and typed for that memory."""
    sharding = (compat.single_device_sharding(jax.devices()[0], memory_kind="pinned_host")
                if source == "one_device" else _mesh_sharding("pinned_host"))
    host = _written_to(sharding)
    unpinned = _written_to(sharding.with_memory_kind("unpinned_host"))
    device = jnp.ones(3)
    destinations = [TARGETS[target](sharding), TARGETS[target](sharding),
                    device.sharding.with_memory_kind("pinned_host")]
    moved = compat.device_put([host, unpinned, device], destinations, src=[None] * 3)
    for x, destination in zip(moved, destinations, strict=True):
        assert x.sharding == destination
        space = {"device": jax.memory.Space.Device, "pinned_host": jax.memory.Space.Host}
        if destination.memory_kind in space:  # (JAX has no type for 'unpinned_host')
            assert jax.typeof(x).memory_space == space[destination.memory_kind], jax.typeof(x)
    want = np.arange(256.0).reshape(4, 64) * 2
    assert np.array_equal(np.asarray(moved[0]), want) and np.array_equal(moved[1], want)
    assert np.array_equal(moved[2], np.ones(3))

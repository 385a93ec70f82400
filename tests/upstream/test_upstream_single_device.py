"""Canary: JAX 0.12.1 deprecates the name `jax.sharding.SingleDeviceSharding` (it warns on
access, and the suite makes warnings errors) for `make_single_device_sharding` and
`is_single_device_sharding`, which `compat.single_device_sharding` and
`compat.is_single_device_sharding` use on every supported JAX. JAX says a later
`make_single_device_sharding` gives a `NamedSharding`; then the one-device special cases
(`placement.typed_sharding`, `call.over_one_device_meshes`, `_plan/tpu.on_chips`) see none,
and this test fails first."""

import jax
import jax.numpy as jnp
import pytest

from eqx_offload._core import compat


def test_the_old_name_is_deprecated_from_0_12_1() -> None:
    # (JAX warns at the first access in a process only: its deprecation table says it.)
    deprecated = getattr(jax.sharding, "_deprecations", {})
    assert ("SingleDeviceSharding" in deprecated) == (jax.__version_info__ >= (0, 12, 1))
    assert hasattr(jax.sharding, "is_single_device_sharding") == (
        jax.__version_info__ >= (0, 12, 1))


@pytest.mark.parametrize("kind", [None, "device", "pinned_host", "unpinned_host"])
def test_one_device_sharding_is_the_one_device_puts_give(kind: str) -> None:
    device = jax.devices()[0]
    sharding = compat.single_device_sharding(device, memory_kind=kind)
    assert compat.is_single_device_sharding(sharding)
    assert sharding.device_set == {device} and sharding.memory_kind in (kind, "device")
    x = jax.device_put(jnp.arange(4.0), sharding)
    assert x.sharding == sharding and x.sharding.memory_kind == (kind or "device")
    assert compat.is_single_device_sharding(jax.device_put(jnp.arange(4.0), device).sharding)


def test_a_one_device_mesh_is_not_one() -> None:
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    assert not compat.is_single_device_sharding(named)

"""Canary (upstream behaviour, not the library's): JAX types an array assembled from
shards as device memory, whatever its sharding's memory kind.

`jax.make_array_from_callback` and `jax.make_array_from_single_device_arrays` (orbax
restores this way) with a `pinned_host` `SingleDeviceSharding` give an array that lives
in host memory but whose type (`jax.typeof(x).memory_space`, what `jax.jit` traces it
as) says device. `filter_jit` retypes such leaves (`_mistyped_host` in `_jit.py`;
`tests/test_jit.py` tests that). Measured on JAX 0.10.2 and 0.12.0.1. If this
canary fails after a JAX upgrade, upstream types them correctly now: the retyping may go
(and the precondition in `test_filter_jit_retypes_host_arrays_assembled_from_shards`
needs updating).
"""

import jax
import jax.numpy as jnp
import numpy as np


def test_assembled_host_arrays_are_typed_as_device_memory():
    host = jax.device_put(jnp.arange(6.0).reshape(2, 3), jax.memory.Space.Host)
    assert jax.typeof(host).memory_space == jax.memory.Space.Host
    value = np.asarray(host)
    assembled = jax.make_array_from_callback(value.shape, host.sharding, lambda index: value[index])
    from_shards = jax.make_array_from_single_device_arrays(
        value.shape, host.sharding, [s.data for s in host.addressable_shards]
    )
    for x in (assembled, from_shards):
        assert x.sharding.memory_kind == "pinned_host"
        assert jax.typeof(x).memory_space == jax.memory.Space.Device, (
            "upstream canary: JAX now types an assembled pinned_host array as host "
            "memory; filter_jit's retyping of such leaves may be unnecessary"
        )

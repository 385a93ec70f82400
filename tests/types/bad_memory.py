"""User mistakes about memory kinds."""

import jax
import jax.numpy as jnp
import optax

import eqx_offload

params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}

# A memory kind that does not exist.
eqx_offload.to_host(params, memory_kind="gpu")  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# The device's memory is not a host memory kind.
eqx_offload.offloaded(optax.adam(1e-3), memory_kind="device")  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# `to_device` goes to the device's default memory: it takes no memory kind.
eqx_offload.to_device(params, memory_kind="device")  # expect: mypy=call-arg pytype=wrong-keyword-args pyright=reportCallIssue pyrefly=unexpected-keyword

# A platform name where a device is expected. (mypy cannot see it: jaxlib ships no
# types for `jax.Device`, so the parameter is `Any` to mypy.)
eqx_offload.memory.supported_memory_kinds("cpu")  # expect: pytype=wrong-arg-types

# The memory kinds are strings, not a set of `MemoryKind`s to index by position.
kinds: list[eqx_offload.types.MemoryKind] = eqx_offload.memory.supported_memory_kinds(jax.devices()[0])  # expect: mypy=assignment pytype=annotation-type-mismatch pyright=reportAssignmentType pyrefly=bad-assignment

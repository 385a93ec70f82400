"""Canary: JAX 0.10's `optimization_barrier` makes a zero tangent or cotangent an array of
zeros in device memory, whatever the memory of its value, so `jax.grad` through a barrier
on a host-memory value that the loss does not read fails; JAX 0.12's keeps the zero
symbolic. `compat.optimization_barrier` works around the first
(`compat.BARRIER_INSTANTIATES_ZEROS`); when this fails, JAX changed it: set the flag by
version again, or drop the shim."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from eqx_offload._core import compat


def _grad_through(barrier: Callable[[Any], Any]) -> bool:
    """Whether `jax.grad` runs through `barrier` on a host-memory value (a state stored
    by an update) beside the device value the loss reads."""

    def loss(s: jax.Array) -> jax.Array:
        stored = jax.device_put(s * jnp.arange(3.0), jax.memory.Space.Host)
        _, x = barrier((stored, s * jnp.arange(3.0)))
        return jnp.sum(x)

    try:
        jax.jit(jax.grad(loss))(1.0)
    except ValueError as error:
        assert "Expected cotangent type" in str(error), error
        return False
    return True


def test_the_barrier_keeps_zeros_symbolic_where_the_flag_says() -> None:
    assert _grad_through(jax.lax.optimization_barrier) != compat.BARRIER_INSTANTIATES_ZEROS
    assert _grad_through(compat.optimization_barrier)

"""Canary: JAX 0.10's `optimization_barrier` makes the zero (co)tangent of a host-memory
value an array in device memory, so `jax.grad` through a barrier on a state leaf that is
not differentiated fails; JAX 0.12's keeps the zero symbolic. `compat.optimization_barrier`
works around the first (`compat.BARRIER_INSTANTIATES_ZEROS`); when this fails, JAX
changed it: set the flag by version again, or drop the shim."""

import jax
import jax.numpy as jnp

from eqx_offload._core import compat


def _grad_through(barrier) -> bool:  # type: ignore[no-untyped-def]  # (a test helper)
    """Whether `jax.grad` through `barrier` on a host-memory leaf, not differentiated,
    beside the differentiated argument, runs."""
    host = jax.device_put(jnp.arange(3.0), jax.memory.Space.Host)

    def loss(s: jax.Array, state: jax.Array) -> jax.Array:
        state, x = barrier((state, s * jnp.arange(3.0)))
        # (moved with its source, as `eqx_offload`'s mover moves a traced leaf)
        fetched = jax.device_put(state, jax.memory.Space.Device, src=jax.memory.Space.Host)
        return jnp.sum(x * fetched)

    try:
        jax.jit(jax.grad(loss))(1.0, host)
    except ValueError as error:
        assert "Expected cotangent type" in str(error), error
        return False
    return True


def test_the_barrier_keeps_zero_tangents_symbolic_where_the_flag_says() -> None:
    assert _grad_through(jax.lax.optimization_barrier) != compat.BARRIER_INSTANTIATES_ZEROS
    assert _grad_through(compat.optimization_barrier)

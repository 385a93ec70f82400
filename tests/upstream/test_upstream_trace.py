"""Canary: JAX's tracers keep their trace in the private `_trace` attribute, by which
`compat.same_trace` pairs a host weight with its gradient (`_models/params.py`'s barrier). If
JAX renames it, `same_trace` answers `False` everywhere and the barrier silently goes."""

import jax
import jax.numpy as jnp

from eqx_offload._core.compat import same_trace


def test_tracers_of_one_trace_share_it_and_others_do_not():
    seen = {}

    def inner(y):
        seen["inner"] = y
        return y * 2

    def outer(x, y):
        seen["x"], seen["y"] = x, y
        return jax.grad(lambda z: jnp.sum(inner(z) * x))(y)

    jax.jit(outer)(jnp.ones(3), jnp.ones(3))
    assert hasattr(seen["x"], "_trace")
    assert same_trace(seen["x"], seen["y"])  # two arguments of one jit trace
    assert not same_trace(seen["x"], seen["inner"])  # a tracer of the grad inside it
    assert not same_trace(jnp.ones(3), jnp.ones(3))  # concrete arrays: no trace

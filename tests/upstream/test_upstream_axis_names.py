"""Canary: `jax.extend.core.unsafe_get_axis_names_DO_NOT_USE` names the axes of the
trace in progress. `offloaded`'s update reads it (`compat.named_axes`) to refuse a state
that `pmap` or `shard_map` brought to device memory; without it, silently no check."""

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from eqx_offload._core.compat import named_axes


def test_the_axes_of_the_trace_in_progress_are_named() -> None:
    assert hasattr(jex, "unsafe_get_axis_names_DO_NOT_USE")
    seen = []

    def f(x: jax.Array) -> jax.Array:
        seen.append(named_axes())
        return x * 2

    jax.vmap(f, axis_name="batch")(jnp.ones(3))
    jax.jit(f)(jnp.ones(3))
    assert seen[0] == ("batch",) and seen[1] == ()
    assert named_axes() == ()

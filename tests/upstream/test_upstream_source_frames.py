"""Canary: JAX records the Python traceback of each traced equation
(`eqn.source_info.traceback.frames`, each with `file_name`, `line_num`,
`function_name`). `filter_jit`'s error for a computation on a host-memory value names
the user's line from it (`compat.source_frames`); without it, silently no line."""

import jax
import jax.numpy as jnp

from eqx_offload._core.compat import source_frames


def _user_step(x: jax.Array) -> jax.Array:
    return jnp.sin(x) * 2


def test_each_equation_knows_the_line_that_made_it() -> None:
    jaxpr = jax.make_jaxpr(_user_step)(jnp.ones(3)).jaxpr
    frames = source_frames(jaxpr.eqns[0])
    mine = [f for f in frames if f[0] == __file__]
    assert mine and mine[0][2] == "_user_step", frames
    assert isinstance(mine[0][1], int) and mine[0][1] > 0

"""Canary: JAX keeps an enclosing jit's donation flags where
`compat.enclosing_donating_jit` reads them (the local `donated_invars` of
`pjit._trace_for_jit`'s frame). `offloaded` refuses to run inside a donating jit (XLA
would abort); if JAX renames the frame or the local, that refusal silently stops."""

from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp

from eqx_offload._core.compat import enclosing_donating_jit


def _seen(wrap: Any) -> Optional[str]:
    found: list[Optional[str]] = []

    def step(x: jax.Array) -> jax.Array:
        found.append(enclosing_donating_jit())
        return x * 2

    wrap(step)(jnp.ones(3))
    return found[0]


def test_the_frame_of_a_donating_jit_is_found_and_others_are_not() -> None:
    assert _seen(lambda f: jax.jit(f, donate_argnums=0)) == "_seen.<locals>.step"
    assert _seen(lambda f: eqx.filter_jit(f, donate="all")) == "_seen.<locals>.step"
    assert _seen(jax.jit) is None
    assert _seen(lambda f: eqx.filter_jit(f, donate="none")) is None
    assert _seen(lambda f: f) is None  # eagerly

"""Canary: JAX keeps a `jax.named_scope` in each traced equation's
`source_info.name_stack`, through transforms and nested jits. `filter_jit` picks its GPU
compiler options from these scopes (`compat.scopes`); without them, silently none."""

import jax
import jax.numpy as jnp

from eqx_offload._core.compat import marked, scopes


def test_a_named_scope_shows_in_the_traced_program_through_transforms() -> None:
    def loss(x: jax.Array) -> jax.Array:
        with marked("streamed"):
            y = jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]
        return jnp.sum(y)

    @jax.jit
    def inner(x: jax.Array) -> jax.Array:  # a nested jit: the scope is in its jaxpr
        with marked("prefetched"):
            return x * 2

    closed = jax.jit(lambda x: jax.grad(loss)(inner(x))).trace(jnp.ones(3)).jaxpr
    stacks = [str(e.source_info.name_stack) for e in closed.jaxpr.eqns]
    assert "transpose(jvp(eqx_offload.streamed))" in stacks, stacks
    assert scopes(closed.jaxpr) == {"streamed", "prefetched"}
    assert scopes(jax.make_jaxpr(lambda x: x * 2)(1.0).jaxpr) == frozenset()

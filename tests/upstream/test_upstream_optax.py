"""Canary (upstream behaviour, not the library's): `optax.MultiSteps` computes on the
state of what it wraps.

`MultiSteps(offloaded(x))` selects between the old and the new inner state with
`jnp.where` outside `offloaded`: a `select_n` on host-memory operands. On a GPU, XLA
turns that into host compute (older versions reject it); the order that works is
`offloaded(MultiSteps(x))`, and `eqx_offload.filter_jit` refuses the other order naming
it (`tests/test_optax.py::test_inner_order_rejected_by_filter_jit`). If this canary fails
after an Optax upgrade, Optax no longer computes on the wrapped state: the docs' advice on
composition order (`docs/concepts.md`, `filter_jit`'s `CompositionError`) may relax.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.extend.core import jaxprs_in_params, Literal

import eqx_offload


def _primitives_on_host(jaxpr: Any, passing: frozenset[str]) -> set[str]:
    """The primitives, at any depth, that read or write a host-memory value, but for
    those in `passing` (transfers and calls that hand values through)."""
    found = set()
    for eqn in jaxpr.eqns:
        spaces = [getattr(v.aval, "memory_space", None)
                  for v in (*eqn.invars, *eqn.outvars) if not isinstance(v, Literal)]
        if jax.memory.Space.Host in spaces and eqn.primitive.name not in passing:
            found.add(eqn.primitive.name)
        for sub in jaxprs_in_params(eqn.params):
            found |= _primitives_on_host(sub, passing)
    return found


def test_multi_steps_computes_on_the_wrapped_state():
    params = {"w": jnp.arange(12.0).reshape(3, 4) / 7, "b": jnp.linspace(-1.0, 1.0, 4)}
    grads = jax.tree.map(jnp.ones_like, params)
    # Transfers, calls, conds and barriers hand host values through unchanged (the
    # streamed applying branch of `offloaded(MultiSteps)` orders its copies by barriers).
    passing = frozenset({"device_put", "jit", "pjit", "closed_call", "cond",
                         "optimization_barrier"})
    plain = optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2)
    wrapped = optax.MultiSteps(eqx_offload.offloaded(optax.adamw(1e-2)), every_k_schedule=2)
    inside = eqx_offload.offloaded(optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2))
    on_host = {
        name: _primitives_on_host(jax.make_jaxpr(opt.update)(grads, opt.init(params), params).jaxpr, passing)
        for name, opt in [("plain", plain), ("wrapped", wrapped), ("inside", inside)]
    }
    assert on_host["plain"] == set() and on_host["inside"] == set()  # the check is sound
    assert "select_n" in on_host["wrapped"], (
        f"upstream canary: MultiSteps(offloaded(...)) no longer computes on host state "
        f"(host primitives: {on_host['wrapped']}); Optax may have changed MultiSteps"
    )

"""Canaries of `optax.MultiSteps`, after an Optax upgrade:

- it keeps what it was built from in the private attributes `compat.multi_steps_parts`
  reads, with the arithmetic `offloaded(MultiSteps(...))` reproduces (if not, adapt
  `multi_steps_parts` and `_optim/accumulate.py`; `tests/optim/test_accumulate.py` checks the bits);
- it computes on the state of what it wraps, so `MultiSteps(offloaded(x))` computes on host
  memory (a `select_n`) and `filter_jit` refuses it (if not, the docs' advice on
  composition order, `docs/concepts.md`, may relax)."""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from helpers import walk_eqns
from jax.extend.core import Literal

import eqx_offload
from eqx_offload._core.compat import multi_steps_parts


def test_multi_steps_parts():
    inner = optax.adam(1e-2)
    skip = optax.skip_not_finite
    for use_grad_mean in (True, False):
        multi = optax.MultiSteps(inner, every_k_schedule=3, use_grad_mean=use_grad_mean,
                                 should_skip_update_fn=skip, accumulator_dtype=jnp.bfloat16)
        parts = multi_steps_parts(multi)
        assert parts.opt is multi.inner_opt
        assert parts.every_k_schedule(jnp.asarray(7)) == 3
        assert parts.should_skip_update_fn is skip
        assert parts.accumulator_dtype == jnp.bfloat16
        acc = parts.acc_update(jnp.asarray(4.0), jnp.asarray(1.0), n_acc=jnp.asarray(2))
        assert float(acc) == (2.0 if use_grad_mean else 5.0)  # the mean of 1, 1, 4; a sum
    schedule = lambda step: step + 1  # noqa: E731  # a schedule is kept as given
    assert multi_steps_parts(optax.MultiSteps(inner, schedule)).every_k_schedule is schedule
    default = multi_steps_parts(optax.MultiSteps(inner, 2)).should_skip_update_fn
    skipped, state = default({"w": jnp.ones(2)}, jnp.asarray(0), None)
    assert skipped.dtype == jnp.bool_ and not bool(skipped) and state == ()


def _primitives_on_host(jaxpr: Any, passing: frozenset[str]) -> set[str]:
    """The primitives, at any depth, that read or write a host-memory value, but `passing`."""
    found = set()
    for eqn in walk_eqns(jaxpr):
        spaces = [getattr(v.aval, "memory_space", None)
                  for v in (*eqn.invars, *eqn.outvars) if not isinstance(v, Literal)]
        if jax.memory.Space.Host in spaces and eqn.primitive.name not in passing:
            found.add(eqn.primitive.name)
    return found


def test_multi_steps_computes_on_the_wrapped_state():
    params = {"w": jnp.arange(12.0).reshape(3, 4) / 7, "b": jnp.linspace(-1.0, 1.0, 4)}
    grads = jax.tree.map(jnp.ones_like, params)
    # Transfers, calls, conds and barriers hand host values through unchanged (the
    # streamed applying branch of `offloaded(MultiSteps)` orders its copies by barriers).
    passing = frozenset({"device_put", "jit", "pjit", "closed_call", "custom_jvp_call", "cond",
                         "optimization_barrier"})
    plain = optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2)
    wrapped = optax.MultiSteps(eqx_offload.offloaded(optax.adamw(1e-2)), every_k_schedule=2)
    inside = eqx_offload.offloaded(optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2))
    on_host = {}
    for name, opt in [("plain", plain), ("wrapped", wrapped), ("inside", inside)]:
        on_host[name] = _primitives_on_host(
            jax.make_jaxpr(opt.update)(grads, opt.init(params), params), passing)
    assert on_host["plain"] == set() and on_host["inside"] == set()  # the check is sound
    assert "select_n" in on_host["wrapped"], (
        f"upstream canary: MultiSteps(offloaded(...)) no longer computes on host state "
        f"(host primitives: {on_host['wrapped']}); Optax may have changed MultiSteps"
    )

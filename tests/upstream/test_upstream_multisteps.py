"""Canary (upstream behaviour, not the library's): `optax.MultiSteps` keeps what it was
built from in private attributes (`_opt`, `_every_k_schedule`, `_acc_update`,
`_should_skip_update_fn`, `_accumulator_dtype`; optax 0.2.8), and its `update` is the
arithmetic `offloaded(MultiSteps(...))` reproduces with them
(`eqx_offload/_compat.py::multi_steps_parts`). If this fails after an Optax upgrade,
Optax renamed them or changed MultiSteps' update: adapt `multi_steps_parts` and
`eqx_offload/_accumulate.py` (tests/test_accumulate.py then says whether the results
are still MultiSteps', bit for bit)."""

import jax.numpy as jnp
import optax

from eqx_offload._compat import multi_steps_parts


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

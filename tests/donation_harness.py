"""The donation harness shared by `tests/test_trap.py` (ours passes) and
`tests/upstream/test_upstream_donation.py` (plain JAX and Equinox abort): a few steps of
an `eqx.nn.MLP` trained with `offloaded(adamw)`, jitted and donated in a given way. Runs
in a fresh process (`isolated.run_isolated`): an abort must not take the suite down."""

import json
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_offload


STEPS = 3


def harness(jit: str, donate: str, order: str, guarded: bool = False) -> dict[str, Any]:
    """`STEPS` steps of an `eqx.nn.MLP` trained with `offloaded(adamw)` (or plain adamw
    for `jit="reference"`), jitted by `jit`, donating per `donate`, returning
    `(model, state, loss)` or `(state, model, loss)` per `order`. Runs in a child.
    Without `guarded`, `offloaded`'s check for a donating plain `jax.jit` /
    `eqx.filter_jit` is off: what plain JAX does (the upstream canary)."""
    from eqx_offload import _lint

    _lint.CHECK_FOREIGN_DONATION = guarded
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    opt = optax.adamw(1e-2) if jit == "reference" else eqx_offload.offloaded(optax.adamw(1e-2))
    state = opt.init(eqx.filter(model, eqx.is_array))
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)

    def step(model, state, x):
        loss, grads = eqx.filter_value_and_grad(
            lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return (model, state, loss) if order == "model_state" else (state, model, loss)

    if jit in ("jax", "reference"):
        params, static = eqx.partition(model, eqx.is_array)

        def array_step(params, state, x):
            out = step(eqx.combine(params, static), state, x)
            return tuple(eqx.filter(o, eqx.is_array) for o in out)

        argnums = {"state": (1,), "all": (0, 1, 2), "all-except-first": (1, 2), "none": ()}
        # The batch matches no output; silence that, as `eqx.filter_jit`'s "all" does.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        jitted = jax.jit(array_step, donate_argnums=argnums[donate])
        model = params
    elif jit == "eqx":
        jitted = eqx.filter_jit(step, donate=donate)
    else:
        jitted = eqx_offload.filter_jit(step, donate=donate)
    losses = []
    for _ in range(STEPS):
        out = jitted(model, state, x)
        model, state, loss = out if order == "model_state" else (out[1], out[0], out[2])
        losses.append(np.asarray(loss).tobytes().hex())
    params = [np.asarray(p).tobytes().hex() for p in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    return {"losses": losses, "params": params}


def harness_many(configs: list[list[str]]) -> dict[str, Any]:
    """`harness` for each `[jit, donate, order]`, in one child (for the configurations
    that must not abort)."""
    return {json.dumps(c): harness(*c) for c in configs}


def guarded_many(configs: list[list[str]]) -> dict[str, Any]:
    """For each `[jit, donate, order]`, with `offloaded`'s check on: the error of the
    run (its type and first words), or `None`."""
    results: dict[str, Any] = {}
    for config in configs:
        try:
            harness(*config, guarded=True)
            results[json.dumps(config)] = {"error": None}
        except Exception as e:  # (reported to the parent)
            results[json.dumps(config)] = {"error": type(e).__name__, "message": str(e)[:300]}
    return results

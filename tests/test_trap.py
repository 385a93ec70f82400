"""The donation trap is real: donating a host-resident optimizer state to plain
`jax.jit(donate_argnums=...)` or `eqx.filter_jit(donate=...)` aborts the process when
JAX pairs a `pinned_host` input with a device output of the same shape and dtype (or the
other way round). `eqx_offload.filter_jit`, in the same harness, passes with the results
of the loop without offload. Each run is a fresh process."""

import json
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from isolated import result_of, run_isolated

import eqx_offload


STEPS = 3
ABORT = "memory kind does not match sharding's memory kind"


def harness(jit: str, donate: str, order: str) -> dict[str, Any]:
    """`STEPS` steps of an `eqx.nn.MLP` trained with `offloaded(adamw)` (or plain adamw
    for `jit="reference"`), jitted by `jit`, donating per `donate`, returning
    `(model, state, loss)` or `(state, model, loss)` per `order`. Runs in a child."""
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


# The configurations where plain JAX/Equinox pairs a donated input with an output in
# the other memory (measured on jax 0.10.2): with `(model, state)` outputs the donated
# host moments meet the device params first; with `(state, model)` the donated device
# params meet the host moments first.
TRAPS = [
    ("jax", "state", "model_state"),
    ("jax", "all-except-first", "model_state"),
    ("jax", "all", "state_model"),
    ("eqx", "all-except-first", "model_state"),
    ("eqx", "all", "state_model"),
]
OURS = [
    ["eqx_offload", donate, order]
    for donate in ("all", "all-except-first")
    for order in ("model_state", "state_model")
]


@pytest.mark.slow
@pytest.mark.parametrize("jit,donate,order", TRAPS)
def test_trap_is_real(jit, donate, order):
    process = run_isolated(harness, jit, donate, order)
    assert process.returncode != 0, (
        f"{jit} with donate={donate!r}, outputs {order} no longer aborts: JAX may have "
        "fixed the donation trap. Update the docs' donation-trap section and this "
        "test.\n" + process.stdout[-2000:]
    )
    assert ABORT in process.stderr, process.stderr[-4000:]


@pytest.mark.slow
def test_ours_passes_in_the_same_harness():
    # One fresh process: the reference (no offload, no donation), ours in every
    # donation mode and output order, and -- to show the harness is sound -- plain
    # `jax.jit` and `eqx.filter_jit` with the same offloaded state but no donation.
    # All give the reference results bit for bit, so the aborts come from the
    # donation alone.
    reference = ["reference", "none", "model_state"]
    sound = [["jax", "none", "model_state"], ["eqx", "none", "state_model"]]
    results = result_of(run_isolated(harness_many, [reference, *OURS, *sound]))
    expected = results.pop(json.dumps(reference))
    assert len(set(expected["losses"])) == STEPS  # it trains
    assert len(results) == len(OURS) + len(sound)
    for config, result in results.items():
        assert result == expected, config

"""A real Equinox training loop: `eqx.nn.MLP`, `offloaded(optax.adamw)`,
`eqx_offload.filter_jit(donate="all")`. Between steps every offloaded leaf is in
`pinned_host`, the params and grads stay on the device, and the loss trajectory is bitwise
equal to the same loop without offload. (Runs in a fresh process: it donates host state.)"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import pytest
from helpers import count_compiles, hex_bits, kind_list
from isolated import call_isolated

import eqx_offload


STEPS = 6


def _data() -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(1), (32, 5))
    return x, jnp.sin(x).sum(axis=1, keepdims=True)


def training_child(offload: bool) -> dict[str, Any]:
    """Trains `STEPS` steps and reports the losses (as bits), the final params (as
    bits) and the memory kinds seen between steps."""
    model = eqx.nn.MLP(5, 1, 16, 2, key=jax.random.key(0))
    inner = optax.adamw(3e-2, weight_decay=1e-2)
    optimizer = eqx_offload.offloaded(inner) if offload else inner
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    jit = eqx_offload.filter_jit(donate="all") if offload else eqx.filter_jit

    @jit
    def step(model, opt_state, x, y):
        def loss_fn(model):
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss, grads

    x, y = _data()
    losses, state_kinds, model_kinds, grad_kinds = [], [], [], []
    state_shapes = [list(leaf.shape) for leaf in jtu.tree_leaves(opt_state)]
    with count_compiles("step") as compiled:
        for _ in range(STEPS):
            model, opt_state, loss, grads = step(model, opt_state, x, y)
            losses.extend(hex_bits(loss))
            state_kinds.append(kind_list(opt_state))
            model_kinds.append(kind_list(model))
            grad_kinds.append(kind_list(grads))
    return {
        "losses": losses,
        "params": hex_bits(eqx.filter(model, eqx.is_array)),
        "state_kinds": state_kinds,
        "state_shapes": state_shapes,
        "model_kinds": model_kinds,
        "grad_kinds": grad_kinds,
        "compiles": len(compiled) if offload else None,
    }


@pytest.mark.slow
def test_training_loop():
    # Both loops in fresh processes (the offloaded one donates host state).
    offloaded = call_isolated(training_child, True)
    plain = call_isolated(training_child, False)

    # The loss trajectory and the final params: bitwise equal to the loop without
    # offload, and it trains (every loss differs).
    assert len(set(plain["losses"])) == STEPS
    assert offloaded["losses"] == plain["losses"]
    assert offloaded["params"] == plain["params"]

    # adamw: (ScaleByAdamState(count, mu, nu), EmptyState, ...): the 0-d count on the
    # device, every moment (1-d and 2-d) in pinned_host, after every step. Without
    # offload everything is on the device.
    expected = ["pinned_host" if shape else "device" for shape in offloaded["state_shapes"]]
    assert expected.count("pinned_host") == 12 and expected.count("device") == 1
    assert offloaded["state_kinds"] == [expected] * STEPS
    assert all(set(kinds) == {"device"} for kinds in plain["state_kinds"])

    # Params and grads stay on the device.
    for run in (offloaded, plain):
        assert all(kinds == ["device"] * 6 for kinds in run["model_kinds"])
        assert all(kinds == ["device"] * 6 for kinds in run["grad_kinds"])

    # One compilation.
    assert offloaded["compiles"] == 1

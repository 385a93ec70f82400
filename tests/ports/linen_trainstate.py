"""Flax linen, as Flax's examples write it: `TrainState.create(apply_fn=..., params=...,
tx=optax.adamw(...))` and a step under `jax.jit(donate_argnums=0)` calling
`state.apply_gradients`. Ported: `offloaded(...)` around `tx`, `eqx_offload.jit` for
`jax.jit`. `style="filter_jit"`: under `eqx_offload.filter_jit`, undonated, where the
Python int `step` is static and recompiles every step (test_jit.py checks the warning)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import optax
from flax.training import train_state

import eqx_offload  # (1) the import

from .common import batches, Recorder, Run


STEPS = 5
IN, WIDTH, OUT, BATCH = 4, 16, 2, 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(WIDTH)(x)
        x = nn.LayerNorm()(nn.gelu(x))
        return nn.Dense(OUT)(x)


def train(port: bool, style: str = "jit") -> Run:
    """`extra`: the final `step`, and per step which leaves passed in were deleted."""
    model = MLP()
    params = model.init(jr.key(0), jnp.ones((1, IN)))["params"]
    tx = optax.adamw(3e-3, weight_decay=1e-3)
    if port:
        tx = eqx_offload.offloaded(tx)  # (2)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    jit = eqx_offload.jit if port else jax.jit  # (3)
    if style == "filter_jit":
        jit = lambda **_: eqx_offload.filter_jit  # noqa: E731

    @jit(donate_argnums=0)
    def train_step(state, x, y):
        def loss_fn(params):
            pred = state.apply_fn({"params": params}, x)
            return jnp.mean((pred - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    recorder = Recorder(port)
    deleted = []
    for x, y in batches(jr.key(1), STEPS, (BATCH, IN)):
        old = state
        with recorder.step():
            state, loss = train_step(state, x, y)
        deleted.append([getattr(a, "is_deleted", lambda: None)() for a in jtu.tree_leaves(old)])
        recorder.record(loss, state.opt_state)
    return recorder.run(state.params, state.opt_state, extra=(state.step, deleted))

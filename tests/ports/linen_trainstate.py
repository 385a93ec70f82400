"""Flax linen: a `TrainState` (`flax.training.train_state`) made with
`TrainState.create(apply_fn=..., params=..., tx=optax.adamw(...))` and a step under
`jax.jit(donate_argnums=0)` that calls `state.apply_gradients`, as Flax's examples
write it. Ported with three lines: the import, `offloaded(...)` around `tx`, and
`eqx_offload.jit` for `jax.jit` (same arguments). `TrainState.create` sets `step=0`, a
Python int: `jax.jit` and `eqx_offload.jit` trace it as a weakly typed int32, so the
step compiles once and returns `step` as an int32 array.

`style="filter_jit"` runs the ported program under `eqx_offload.filter_jit` (without
donation) instead, where a Python scalar leaf is static: it compiles again at every
step, as `step` changes (tests/test_jit.py checks the warning that says so)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import optax
from flax.training import train_state

import eqx_offload  # (1) the import

from .common import Recorder, Run


STEPS = 5
IN, WIDTH, OUT, BATCH = 4, 16, 2, 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(WIDTH)(x)
        x = nn.LayerNorm()(nn.gelu(x))
        return nn.Dense(OUT)(x)


def data(key: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    out = []
    for k in jr.split(key, STEPS):
        x = jr.normal(k, (BATCH, IN))
        out.append((x, jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1)))
    return out


def train(port: bool, style: str = "jit") -> Run:
    """Returns the run; its `extra` is the final `step` and, per step, which array
    leaves of the state passed in were deleted (donated) by the call."""
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
    for x, y in data(jr.key(1)):
        old = state
        with recorder.step():
            state, loss = train_step(state, x, y)
        deleted.append([getattr(a, "is_deleted", lambda: None)() for a in jtu.tree_leaves(old)])
        recorder.record(loss, state.opt_state)
    return recorder.run(state.params, state.opt_state, extra=(state.step, deleted))

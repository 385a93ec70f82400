"""Flax NNX: `nnx.Optimizer(model, tx, wrt=nnx.Param)` in NNX's two documented styles:

- `"nnx_jit"`: `train_step(model, optimizer, x, y)` under `nnx.jit`, undonated. Ported: the
    import, `offloaded(...)`, and `eqx_offload.nnx_jit` for `nnx.jit` (`nnx.jit` itself,
    `nnx_jit=False`, compiles twice: the model starts uncommitted, the offloaded state and
    the step's outputs are committed).
- `"functional"`: `nnx.split` once, a pure step under `eqx.filter_jit(donate="all")` with
    `nnx.merge` inside (NNX's "functional API"). Ported: the usual three lines; the way to
    donate an offloaded state (docs/nnx.md).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from flax import nnx

import eqx_offload  # (1) the import

from .common import batches, Recorder, Run


STEPS = 5
IN, WIDTH, OUT, BATCH = 4, 16, 2, 32


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(IN, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.linear2 = nnx.Linear(WIDTH, OUT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(jax.nn.gelu(self.norm(self.linear1(x))))


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def train(port: bool, style: str = "nnx_jit", donate: str = "all",
          nnx_jit: bool = True) -> Run:
    model = MLP(nnx.Rngs(0))
    tx = optax.adamw(1e-2, weight_decay=1e-3)
    if port:
        tx = eqx_offload.offloaded(tx)  # (2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    recorder = Recorder(port)
    data = batches(jr.key(1), STEPS, (BATCH, IN))
    deleted = []  # (functional: per step, whether every array passed in was consumed)
    if style == "nnx_jit":
        @(eqx_offload.nnx_jit if port and nnx_jit else nnx.jit)  # (3)
        def train_step(model, optimizer, x, y):
            loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
            optimizer.update(model, grads)
            return loss

        for x, y in data:
            with recorder.step():
                loss = train_step(model, optimizer, x, y)
            recorder.record(loss, optimizer.opt_state)
    else:
        graphdef, state = nnx.split((model, optimizer))
        jit = eqx_offload.filter_jit if port else eqx.filter_jit  # (3)

        @jit(donate=donate)
        def train_step(state, x, y):
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
            optimizer.update(model, grads)
            return nnx.state((model, optimizer)), loss

        for x, y in data:
            old = jax.tree.leaves(state)
            with recorder.step():
                state, loss = train_step(state, x, y)
            deleted.append(all(a.is_deleted() for a in old))
            nnx.update((model, optimizer), state)
            recorder.record(loss, optimizer.opt_state)
    return recorder.run(nnx.state(model), optimizer.opt_state,
                        extra=(jax.tree.leaves(optimizer.step), deleted))

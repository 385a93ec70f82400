"""Flax NNX: an `nnx.Module` trained with `nnx.Optimizer(model, tx, wrt=nnx.Param)`,
in the two styles NNX documents:

- `"nnx_jit"`: a `train_step(model, optimizer, x, y)` under `nnx.jit` that updates
    both in place, without donation. Ported: the import, `offloaded(...)` around `tx`,
    and one line that commits the model and optimizer to their device before the
    first step (without it `nnx.jit` compiles the step twice: the model and the
    optimizer's step counter start uncommitted, the offloaded state is committed).
- `"functional"`: `nnx.split` once, a pure step on the state under `eqx.filter_jit`
    with `donate="all"`, `nnx.merge` inside it (NNX's "functional API" for speed).
    Ported: the import, `offloaded(...)`, `eqx_offload.filter_jit`. This is the way to
    donate an offloaded state (see docs/nnx.md: `nnx.jit(..., donate_argnums=...)`
    lets JAX pair a host input with a device output, which aborts the process).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from flax import nnx

import eqx_offload  # (1) the import

from .common import Recorder, Run


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


def data(key: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    out = []
    for k in jr.split(key, STEPS):
        x = jr.normal(k, (BATCH, IN))
        out.append((x, jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1)))
    return out


def commit(*nodes: object) -> None:
    """The one line of the port under `nnx.jit`: every array of `nodes` committed to
    the default device (host-resident leaves stay in host memory)."""
    nnx.update(nodes, eqx_offload.filter_shard(
        nnx.state(nodes), jax.sharding.SingleDeviceSharding(jax.devices()[0])))


def train(port: bool, style: str = "nnx_jit", donate: str = "all", commit_first: bool = True) -> Run:
    model = MLP(nnx.Rngs(0))
    tx = optax.adamw(1e-2, weight_decay=1e-3)
    if port:
        tx = eqx_offload.offloaded(tx)  # (2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    recorder = Recorder(port)
    batches = data(jr.key(1))
    if style == "nnx_jit":
        if port and commit_first:
            commit(model, optimizer)  # (3)

        @nnx.jit
        def train_step(model, optimizer, x, y):
            loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
            optimizer.update(model, grads)
            return loss

        for x, y in batches:
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

        for x, y in batches:
            with recorder.step():
                state, loss = train_step(state, x, y)
            nnx.update((model, optimizer), state)
            recorder.record(loss, optimizer.opt_state)
    return recorder.run(nnx.state(model), optimizer.opt_state,
                        extra=jax.tree.leaves(optimizer.step))  # the step counter

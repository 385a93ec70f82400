"""A model full of non-array leaves: an activation function and a Python float in
ordinary (non-static) fields, a name string, an int, `eqx.nn.Lambda`, `eqx.nn.Dropout`
(its rate and flag), a PRNG key and an integer array that the optimizer must not see
(`eqx.is_inexact_array`, as Equinox's examples filter)."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqx_offload  # (1) the import

from .common import batches, Recorder, Run


STEPS = 5
BATCH = 16


class Block(eqx.Module):
    linear: eqx.nn.Linear
    activation: Callable[[jax.Array], jax.Array]  # a function as an ordinary field
    scale: float  # a Python float as an ordinary field
    name: str
    dropout: eqx.nn.Dropout

    def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
        return self.dropout(self.scale * self.activation(self.linear(x)), key=key)


class Net(eqx.Module):
    blocks: list[Block]
    head: eqx.nn.Sequential
    depth: int
    mask: jax.Array  # an integer array: not a parameter
    key: jax.Array  # a typed PRNG key: not a parameter

    def __init__(self, key: jax.Array):
        keys = jr.split(key, 4)
        self.blocks = [
            Block(eqx.nn.Linear(4, 8, key=keys[0]), jax.nn.gelu, 0.5, "first",
                  eqx.nn.Dropout(0.25)),
            Block(eqx.nn.Linear(8, 8, key=keys[1]), jnp.tanh, 2.0, "second",
                  eqx.nn.Dropout(0.1)),
        ]
        self.head = eqx.nn.Sequential([eqx.nn.Lambda(jax.nn.silu),
                                       eqx.nn.Linear(8, 1, key=keys[2])])
        self.depth = len(self.blocks)
        self.mask = jnp.array([1, 0, 1, 1, 0, 1, 1, 1], dtype=jnp.int32)
        self.key = keys[3]

    def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
        for block, k in zip(self.blocks, jr.split(key, self.depth)):
            x = block(x, k)
        return self.head(x * self.mask)


def train(port: bool, donate: str = "none") -> Run:
    model = Net(jr.key(0))
    optim = optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3, weight_decay=1e-2))
    if port:
        optim = eqx_offload.offloaded(optim)  # (2)
    jit = eqx_offload.filter_jit if port else eqx.filter_jit  # (3)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_value_and_grad
    def compute_loss(model, x, y, key):
        pred = jax.vmap(model)(x, jr.split(key, x.shape[0]))
        return jnp.mean((pred - y) ** 2)

    @jit(donate=donate)
    def make_step(model, opt_state, x, y):
        key, new_key = jr.split(model.key)
        loss, grads = compute_loss(model, x, y, key)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, updates)
        model = eqx.tree_at(lambda m: m.key, model, new_key)
        return model, opt_state, loss

    recorder = Recorder(port)
    data = batches(jr.key(1), STEPS, (BATCH, 4), lambda x: jnp.sum(x**2, axis=1, keepdims=True))
    for x, y in data:
        with recorder.step():
            model, opt_state, loss = make_step(model, opt_state, x, y)
        recorder.record(loss, opt_state)
    return recorder.run(model, opt_state)

"""Equinox's vision-transformer example, in small: attention blocks with `eqx.nn.Dropout`
(a float and a bool among the leaves), `optax.adamw` with a schedule, and the example's
`optimizer.update(grads, opt_state, model)` with the whole model as `params`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqx_offload  # (1) the import

from .common import Recorder, Run


STEPS = 5
BATCH, PATCHES, PATCH, DIM, CLASSES = 8, 4, 6, 8, 3


class AttentionBlock(eqx.Module):
    layer_norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    layer_norm2: eqx.nn.LayerNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear
    dropout1: eqx.nn.Dropout
    dropout2: eqx.nn.Dropout

    def __init__(self, key: jax.Array, dropout_rate: float = 0.1):
        k1, k2, k3 = jr.split(key, 3)
        self.layer_norm1 = eqx.nn.LayerNorm(DIM)
        self.attention = eqx.nn.MultiheadAttention(2, DIM, key=k1)
        self.layer_norm2 = eqx.nn.LayerNorm(DIM)
        self.linear1 = eqx.nn.Linear(DIM, 2 * DIM, key=k2)
        self.linear2 = eqx.nn.Linear(2 * DIM, DIM, key=k3)
        self.dropout1 = eqx.nn.Dropout(dropout_rate)
        self.dropout2 = eqx.nn.Dropout(dropout_rate)

    def __call__(self, x: jax.Array, enable_dropout: bool, key: jax.Array) -> jax.Array:
        k1, k2 = jr.split(key)
        y = jax.vmap(self.layer_norm1)(x)
        x = x + self.attention(y, y, y)
        y = jax.vmap(self.layer_norm2)(x)
        y = jax.nn.gelu(jax.vmap(self.linear1)(y))
        y = self.dropout1(y, inference=not enable_dropout, key=k1)
        y = jax.vmap(self.linear2)(y)
        return x + self.dropout2(y, inference=not enable_dropout, key=k2)


class VisionTransformer(eqx.Module):
    patch_embedding: eqx.nn.Linear
    positional_embedding: jax.Array
    cls_token: jax.Array
    blocks: list[AttentionBlock]
    dropout: eqx.nn.Dropout
    head: eqx.nn.Linear
    num_layers: int

    def __init__(self, key: jax.Array, num_layers: int = 2):
        keys = jr.split(key, num_layers + 4)
        self.patch_embedding = eqx.nn.Linear(PATCH, DIM, key=keys[0])
        self.positional_embedding = jr.normal(keys[1], (PATCHES + 1, DIM))
        self.cls_token = jr.normal(keys[2], (1, DIM))
        self.blocks = [AttentionBlock(k) for k in keys[4:]]
        self.dropout = eqx.nn.Dropout(0.1)
        self.head = eqx.nn.Linear(DIM, CLASSES, key=keys[3])
        self.num_layers = num_layers

    def __call__(self, x: jax.Array, enable_dropout: bool, key: jax.Array) -> jax.Array:
        x = jax.vmap(self.patch_embedding)(x)
        x = jnp.concatenate((self.cls_token, x), axis=0) + self.positional_embedding
        keys = jr.split(key, self.num_layers + 1)
        x = self.dropout(x, inference=not enable_dropout, key=keys[0])
        for block, k in zip(self.blocks, keys[1:]):
            x = block(x, enable_dropout, k)
        return self.head(x[0])


def compute_grads(model, images, labels, key):
    logits = jax.vmap(model, in_axes=(0, None, 0))(images, True, jr.split(key, images.shape[0]))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def data(key: jax.Array) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    out = []
    for k in jr.split(key, STEPS):
        kx, ky, kd = jr.split(k, 3)
        out.append((jr.normal(kx, (BATCH, PATCHES, PATCH)),
                    jr.randint(ky, (BATCH,), 0, CLASSES), kd))
    return out


def train(port: bool, donate: str = "none") -> Run:
    model = VisionTransformer(jr.key(0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 2, STEPS)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, weight_decay=1e-2))
    if port:
        optimizer = eqx_offload.offloaded(optimizer)  # (2)
    jit = eqx_offload.filter_jit if port else eqx.filter_jit  # (3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @jit(donate=donate)
    def step_fn(model, images, labels, optimizer_state, key):
        loss, grads = eqx.filter_value_and_grad(compute_grads)(model, images, labels, key)
        updates, new_state = optimizer.update(grads, optimizer_state, model)
        model = eqx.apply_updates(model, updates)
        return model, new_state, loss

    recorder = Recorder(port)
    for images, labels, key in data(jr.key(1)):
        with recorder.step():
            model, opt_state, loss = step_fn(model, images, labels, opt_state, key)
        recorder.record(loss, opt_state)
    return recorder.run(model, opt_state)

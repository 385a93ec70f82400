"""A Levanter-style stacked language model trained with a micro-batch scan: each step
scans its micro-batches, sums their gradients in the scan's carry and updates once (as
MaxText and Levanter accumulate). Blocks (LayerNorm, causal multi-head attention, MLP)
stacked with `eqx.filter_vmap`, called per sequence with `jax.vmap`.

Plain: the blocks on the device, run by a rematted `jax.lax.scan`, `optax.adamw`.
Ported with the blocks' weights in host memory: `to_host` blocks run by `scan_layers`,
`host_weights_optimizer` (or `master_weights` over bf16 blocks), each micro-batch's
gradient brought to the device as it is added (`to_device(g)`: a host weight's gradient
is in host memory)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqx_offload

from .common import Recorder, Run


VOCAB, WIDTH, HEADS, SEQ, DEPTH = 32, 32, 4, 16, 3
STEPS, MICRO, BATCH = 4, 3, 2


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key: jax.Array) -> None:
        k1, k2 = jr.split(key)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(WIDTH), eqx.nn.LayerNorm(WIDTH)
        self.attention = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=k1)
        self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 4 * WIDTH, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = jax.vmap(self.ln1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class LM(eqx.Module):
    embedding: eqx.nn.Embedding
    blocks: Block
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k1, k2, k3 = jr.split(key, 3)
        self.embedding = eqx.nn.Embedding(VOCAB, WIDTH, key=k1)
        self.blocks = eqx.filter_vmap(Block)(jr.split(k2, DEPTH))
        self.ln = eqx.nn.LayerNorm(WIDTH)
        self.head = eqx.nn.Linear(WIDTH, VOCAB, key=k3)

    def __call__(self, tokens: jax.Array, scan: Any) -> jax.Array:
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        x = jax.vmap(self.embedding)(tokens)
        x = scan(self.blocks, x, lambda block, h: block(h, mask))
        return jax.vmap(self.head)(jax.vmap(self.ln)(x))


def rematted_scan(blocks: Any, x: jax.Array, call: Any) -> jax.Array:
    """The plain program's layer loop: `jax.lax.scan` over the stack, each block rematted."""
    dynamic, static = eqx.partition(blocks, eqx.is_array)

    @jax.checkpoint
    def body(h: jax.Array, arrays: Any) -> jax.Array:
        return call(eqx.combine(arrays, static), h)

    return jax.lax.scan(lambda h, arrays: (body(h, arrays), None), x, dynamic)[0]


def loss_fn(model: LM, tokens: jax.Array, scan: Any) -> jax.Array:
    logits = jax.vmap(lambda t: model(t, scan))(tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1], tokens[:, 1:]).mean()


def data() -> list[jax.Array]:
    """`STEPS` steps of `MICRO` micro-batches of `BATCH` sequences."""
    return [jr.randint(k, (MICRO, BATCH, SEQ), 0, VOCAB) for k in jr.split(jr.key(7), STEPS)]


def make_step(update: Any, port: bool) -> Any:
    jit = eqx_offload.filter_jit if port else eqx.filter_jit
    # The port's one change in the sum: each gradient to the device as it is added.
    bring = eqx_offload.to_device if port else (lambda g: g)
    scan = eqx_offload.scan_layers if port else rematted_scan

    @jit(donate="all-except-first")
    def step(tokens: jax.Array, model: LM, opt_state: Any) -> Any:
        def micro(acc: Any, batch: jax.Array) -> Any:
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch, scan)
            return jax.tree.map(lambda a, g: a + bring(g).astype(a.dtype), acc, grads), loss

        params = eqx.filter(model, eqx.is_inexact_array)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        total, losses = jax.lax.scan(micro, zeros, tokens)
        grads = jax.tree.map(lambda t, p: (t / MICRO).astype(p.dtype), total, params)
        model, opt_state = update(grads, opt_state, model)
        return losses.mean(), model, opt_state

    return step


def _fit(port: bool, step: Any, model: LM, opt_state: Any) -> Run:
    recorder = Recorder(port)
    for tokens in data():
        with recorder.step():
            loss, model, opt_state = step(tokens, model, opt_state)
        recorder.record(loss, opt_state)
    return recorder.run(model, opt_state)


def train(port: bool) -> Run:
    """AdamW; ported: the blocks in host memory, `host_weights_optimizer`."""
    model = LM(jr.key(0))
    optimizer = optax.adamw(3e-3)
    if port:
        model = eqx.tree_at(lambda m: m.blocks, model, replace_fn=eqx_offload.to_host)
        host_optimizer = eqx_offload.host_weights_optimizer(optimizer)
        opt_state, update = host_optimizer.init(model), host_optimizer.update
    else:
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

        def update(grads: Any, opt_state: Any, model: LM) -> Any:
            updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state

    return _fit(port, make_step(update, port), model, opt_state)


def train_bf16(port: bool) -> Run:
    """bf16 blocks with fp32 master weights (`master_weights`); plain: the master
    weights and the state on the device (`offload=None`) and the blocks too."""
    model = LM(jr.key(0))
    master = eqx_offload.master_weights(optax.adamw(3e-3), offload=(
        eqx_offload.offloaded if port else None))
    model, opt_state = master.init(model)
    if port:
        model = eqx.tree_at(lambda m: m.blocks, model, replace_fn=eqx_offload.to_host)
    return _fit(port, make_step(master.update, port), model, opt_state)

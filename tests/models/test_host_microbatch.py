"""Micro-batches with the stacked layers in host memory, on a levanter-style LM (blocks
stacked with `eqx.filter_vmap`, a rematted scan, gradients summed in a `lax.scan`,
levanter's `microbatched`): the natural program, which adds each micro-batch's host
gradient as it is, is refused with the fix (`eqx_offload.to_device(g)`); with the fix,
the summed gradient is the device program's within the rounding of a program XLA:CPU
compiles otherwise (checked with SGD at a rate of 1, whose step subtracts the sum)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload
from eqx_offload.errors import CompositionError


VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH, MICRO = 64, 32, 2, 2, 8, 4, 2


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(WIDTH), eqx.nn.LayerNorm(WIDTH)
        self.attn = eqx.nn.MultiheadAttention(HEADS, WIDTH, use_query_bias=True,
                                              use_output_bias=True, key=k1)
        self.up = eqx.nn.Linear(WIDTH, 4 * WIDTH, key=k2)
        self.down = eqx.nn.Linear(4 * WIDTH, WIDTH, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((SEQ, SEQ), bool)))
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(lambda v: self.down(jax.nn.gelu(self.up(v))))(h)


class LM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block
    head: eqx.nn.Linear
    plain: bool = eqx.field(static=True)

    def __init__(self, key: jax.Array, plain: bool) -> None:
        ke, kb, kh = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=ke)
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(kb, LAYERS))
        self.head = eqx.nn.Linear(WIDTH, VOCAB, use_bias=False, key=kh)
        self.plain = plain

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jax.vmap(self.embed)(tokens)
        if self.plain:  # the plain program: a rematted `lax.scan`
            dynamic, static = eqx.partition(self.blocks, eqx.is_array)

            @jax.checkpoint
            def body(h: jax.Array, d: Any) -> tuple[jax.Array, None]:
                return eqx.combine(d, static)(h), None

            x = jax.lax.scan(body, x, dynamic)[0]
        else:
            x = eqx_offload.scan_layers(self.blocks, x)
        return jax.vmap(self.head)(x)


def loss(model: LM, tokens: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def grad_sum(model: LM, tokens: jax.Array, fix: bool) -> Any:
    micro = tokens.reshape(MICRO, BATCH // MICRO, SEQ + 1)

    def step(total: Any, batch: jax.Array) -> tuple[Any, None]:
        grads = eqx.filter_grad(loss)(model, batch)
        if fix:
            grads = eqx_offload.to_device(grads)
        return jax.tree.map(jnp.add, total, grads), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), eqx.filter(model, eqx.is_array))
    return jax.lax.scan(step, zeros, micro)[0]


def _tokens() -> jax.Array:
    return jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)


def _plain() -> Any:
    model = LM(jax.random.key(0), plain=True)
    optimizer = optax.sgd(1.0)

    @eqx.filter_jit
    def step(model: LM, state: Any, tokens: jax.Array) -> Any:
        updates, state = optimizer.update(grad_sum(model, tokens, False), state)
        return eqx.apply_updates(model, updates)

    return model, step(model, optimizer.init(eqx.filter(model, eqx.is_array)), _tokens())


def _host(fix: bool) -> Any:
    model = LM(jax.random.key(0), plain=False)
    model = eqx.tree_at(lambda m: m.blocks, model, replace_fn=eqx_offload.to_host)
    optimizer = eqx_offload.host_weights_optimizer(optax.sgd(1.0))

    @eqx_offload.filter_jit(donate="all")
    def step(model: LM, state: Any, tokens: jax.Array) -> Any:
        return optimizer.update(grad_sum(model, tokens, fix), state, model)[0]

    return step(model, optimizer.init(model), _tokens())


def test_the_natural_program_is_refused_with_the_fix() -> None:
    with pytest.raises(CompositionError) as info:
        _host(fix=False)
    message = str(info.value)
    assert message.startswith("Bring `grads.blocks.")
    assert "acc + eqx_offload.to_device(g)" in message


def test_the_sum_within_the_rounding_of_another_program() -> None:
    """Each leaf's summed gradient (the SGD step's change) within 1e-5 of that leaf's
    largest gradient element (docs/models.md: the bound)."""
    before, plain = _plain()
    host = _host(fix=True)
    assert host.blocks.up.weight.sharding.memory_kind == "pinned_host"
    for w, a, b in zip(*(jax.tree.leaves(eqx.filter(m, eqx.is_array))
                         for m in (before, plain, host)), strict=True):
        w, a, b = np.asarray(w), np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(w - a))

"""A Llama-style decoder in Equinox, and the published Llama shapes from 1B to 70B.

The model the capacity planner (`python bench/capacity_run.py`) sizes: RMSNorm,
rotary attention with grouped key/value heads, a SwiGLU MLP, untied input and output
embeddings, its blocks stacked with `eqx.filter_vmap` and run with
`eqx_offload.scan_layers` (each block rematerialised in the backward pass, its weights
brought from host memory where they live there, its input kept in host memory for the
backward pass with `offload_input`). It trains (`llama_loss`) and runs on the CPU like
any Equinox model; at the ladder's sizes it is only ever built abstractly
(`eqx_offload.checkpoint.filter_eval_shape`), so no array of it is allocated.
"""

import dataclasses
import functools
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_offload


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The size of a `Llama` and of its micro-batch.

    **Fields:** `name`; `width` (the model dimension); `layers`; `heads` (query heads);
    `kv_heads` (key/value heads: grouped-query attention where fewer); `ffn` (the
    SwiGLU MLP's hidden size); `vocab`; `seq` (tokens per sequence); `batch`
    (sequences per micro-batch, per device).
    """

    name: str
    width: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int = 4096
    batch: int = 1

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def block_params(self) -> int:
        """Parameters of one block: four attention projections, three MLP matrices,
        two norms."""
        d, kv = self.width, self.kv_heads * self.head_dim
        return 2 * d * d + 2 * d * kv + 3 * d * self.ffn + 2 * d

    @property
    def params(self) -> int:
        """Parameters of the model: embeddings in and out (untied), the blocks, the
        final norm."""
        return 2 * self.vocab * self.width + self.layers * self.block_params + self.width

    def with_layers(self, layers: int) -> "LlamaShape":
        """The same shape at another depth, named after its size."""
        shape = dataclasses.replace(self, layers=layers)
        return dataclasses.replace(shape, name=f"{self.name} x{layers}L ({shape.params / 1e9:.1f}B)")


LLAMA_SHAPES: tuple[LlamaShape, ...] = (
    LlamaShape("Llama 3.2 1B", 2048, 16, 32, 8, 8192, 128256),
    LlamaShape("Llama 3.2 3B", 3072, 28, 24, 8, 8192, 128256),
    LlamaShape("Llama 2 7B", 4096, 32, 32, 32, 11008, 32000),
    LlamaShape("Llama 3.1 8B", 4096, 32, 32, 8, 14336, 128256),
    LlamaShape("Llama 2 13B", 5120, 40, 40, 40, 13824, 32000),
    LlamaShape("Code Llama 34B", 8192, 48, 64, 8, 22016, 32000),
    LlamaShape("Llama 3.1 70B", 8192, 80, 64, 8, 28672, 128256),
)
"""The published Llama shapes (Meta's model cards and `config.json`s), with untied
embeddings (Llama 3.2 1B and 3B tie theirs, so they are 0.26B and 0.39B larger here)."""


def ladder(shapes: tuple[LlamaShape, ...] = LLAMA_SHAPES, steps: int = 2) -> list[LlamaShape]:
    """The published shapes and, between each and the next, `steps` intermediate depths
    of the smaller one's width (e.g. the 13B shape at 51 and 62 layers), sorted by
    parameters: the sizes the capacity planner searches."""
    found = list(shapes)
    for small, large in zip(shapes, shapes[1:]):
        for i in range(1, steps + 1):
            target = small.params + (large.params - small.params) * i / (steps + 1)
            layers = round((target - (small.params - small.layers * small.block_params))
                           / small.block_params)
            if small.layers < layers:
                found.append(small.with_layers(layers))
    return sorted(found, key=lambda s: s.params)


def _astype(dtype: Any, x: jax.Array) -> jax.Array:
    return x.astype(dtype)


class RMSNormed(eqx.Module):
    """`eqx.nn.RMSNorm` over each token, computed in fp32 (as Llama does) and returned
    in the input's dtype."""

    norm: eqx.nn.RMSNorm

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.vmap(self.norm)(x.astype(jnp.float32)).astype(x.dtype)


class Attention(eqx.Module):
    """Causal self-attention with rotary position embeddings and grouped key/value
    heads."""

    wq: eqx.nn.Linear
    wk: eqx.nn.Linear
    wv: eqx.nn.Linear
    wo: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    kv_heads: int = eqx.field(static=True)

    def __init__(self, shape: LlamaShape, key: jax.Array) -> None:
        kq, kk, kv, ko = jax.random.split(key, 4)
        d, hd = shape.width, shape.head_dim
        self.wq = eqx.nn.Linear(d, shape.heads * hd, use_bias=False, key=kq)
        self.wk = eqx.nn.Linear(d, shape.kv_heads * hd, use_bias=False, key=kk)
        self.wv = eqx.nn.Linear(d, shape.kv_heads * hd, use_bias=False, key=kv)
        self.wo = eqx.nn.Linear(shape.heads * hd, d, use_bias=False, key=ko)
        self.heads, self.kv_heads = shape.heads, shape.kv_heads

    def __call__(self, x: jax.Array, rope: eqx.nn.RotaryPositionalEmbedding) -> jax.Array:
        seq = x.shape[0]

        def heads(linear: eqx.nn.Linear, n: int) -> jax.Array:
            return jax.vmap(linear)(x).reshape(seq, n, -1)

        def rotate(h: jax.Array) -> jax.Array:  # (seq, n, head_dim), per head
            return jax.vmap(rope, in_axes=1, out_axes=1)(h.astype(jnp.float32)).astype(x.dtype)

        q = rotate(heads(self.wq, self.heads))
        k = rotate(heads(self.wk, self.kv_heads))
        v = heads(self.wv, self.kv_heads)
        out = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                           implementation="xla")[0]
        return jax.vmap(self.wo)(out.reshape(seq, -1))


class SwiGLU(eqx.Module):
    """Llama's MLP: `down(silu(gate(x)) * up(x))`."""

    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, shape: LlamaShape, key: jax.Array) -> None:
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(shape.width, shape.ffn, use_bias=False, key=kg)
        self.up = eqx.nn.Linear(shape.width, shape.ffn, use_bias=False, key=ku)
        self.down = eqx.nn.Linear(shape.ffn, shape.width, use_bias=False, key=kd)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.vmap(self.down)(jax.nn.silu(jax.vmap(self.gate)(x)) * jax.vmap(self.up)(x))


class DecoderBlock(eqx.Module):
    """A pre-norm Llama block: `x + attention(norm(x))`, then `x + mlp(norm(x))`."""

    attention_norm: RMSNormed
    attention: Attention
    mlp_norm: RMSNormed
    mlp: SwiGLU

    def __init__(self, shape: LlamaShape, key: jax.Array) -> None:
        ka, km = jax.random.split(key)
        self.attention_norm = RMSNormed(eqx.nn.RMSNorm(shape.width, use_bias=False))
        self.attention = Attention(shape, ka)
        self.mlp_norm = RMSNormed(eqx.nn.RMSNorm(shape.width, use_bias=False))
        self.mlp = SwiGLU(shape, km)

    def __call__(self, x: jax.Array, rope: eqx.nn.RotaryPositionalEmbedding) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class Llama(eqx.Module):
    """A Llama-style decoder-only language model: token embedding, `layers` stacked
    `DecoderBlock`s (every array leaf of `blocks` has a leading axis of `layers`), a
    final RMSNorm and an untied output projection. `model(tokens)` maps one sequence
    of token ids, shape `(seq,)`, to logits `(seq, vocab)`.

    `offload_input=True` keeps each block's input in host memory for the backward pass
    (`eqx_offload.scan_layers(..., offload_input=True)`). The blocks' weights are
    brought from host memory inside the scan wherever they live there
    (`eqx.tree_at(lambda m: m.blocks, model, replace_fn=eqx_offload.to_host)`).
    `model(tokens, accumulate)` passes a gradient sum of the blocks to `scan_layers`
    (its `accumulate`: the blocks' gradient is then that sum plus their own).
    """

    embed: eqx.nn.Embedding
    blocks: DecoderBlock
    norm: RMSNormed
    unembed: eqx.nn.Linear
    rope: eqx.nn.RotaryPositionalEmbedding
    offload_input: bool = eqx.field(static=True)

    def __init__(self, shape: LlamaShape, key: jax.Array, *, offload_input: bool = False,
                 dtype: Optional[Any] = None) -> None:
        ke, kb, ku = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(shape.vocab, shape.width, key=ke)
        # (`eqx.filter_vmap`, which `eqx_offload.filter_make` can run a layer at a time)
        self.blocks = eqx_offload.stack_layers(functools.partial(DecoderBlock, shape),
                                               jax.random.split(kb, shape.layers))
        self.norm = RMSNormed(eqx.nn.RMSNorm(shape.width, use_bias=False))
        self.unembed = eqx.nn.Linear(shape.width, shape.vocab, use_bias=False, key=ku)
        self.rope = eqx.nn.RotaryPositionalEmbedding(shape.head_dim, theta=500000.0)
        self.offload_input = offload_input
        if dtype is not None:
            floating = eqx.filter(self, eqx.is_inexact_array)
            cast = jax.tree.map(functools.partial(_astype, dtype), floating)
            self.embed, self.blocks, self.norm, self.unembed = (
                cast.embed, cast.blocks, cast.norm, cast.unembed)

    def __call__(self, tokens: jax.Array, accumulate: Optional[Any] = None) -> jax.Array:
        x = jax.vmap(self.embed)(tokens)

        def call(block: DecoderBlock, x: jax.Array) -> jax.Array:
            return block(x, self.rope)

        x = eqx_offload.scan_layers(self.blocks, x, call, offload_input=self.offload_input,
                                    accumulate=accumulate)
        return jax.vmap(self.unembed)(self.norm(x))


def llama_loss(model: Llama, tokens: jax.Array, accumulate: Optional[Any] = None) -> jax.Array:
    """Next-token cross-entropy (fp32) of `model` on a batch of sequences `(batch, seq)`
    (`accumulate`: a gradient sum of the blocks, as `scan_layers` takes it)."""
    call = model if accumulate is None else functools.partial(model, accumulate=accumulate)
    logits = jax.vmap(call)(tokens[:, :-1]).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))

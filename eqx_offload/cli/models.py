"""What the demo and the benchmark train: the optimizers, two models (an MLP and a small
decoder-only transformer language model), their synthetic data, and the training step."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax


OPTIMIZERS: dict[str, Callable[[float], optax.GradientTransformation]] = {
    "adamw": lambda lr: optax.adamw(lr),
    "adam": lambda lr: optax.adam(lr),
    "adafactor": lambda lr: optax.adafactor(lr),
    "lion": lambda lr: optax.lion(lr),
    "sgd": lambda lr: optax.sgd(lr, momentum=0.9),
}
"""The optimizers the demo and the benchmark offer, by name: `name -> factory(lr)`."""

Loss = Callable[[Any, Any], jax.Array]
"""`loss(model, batch) -> scalar`."""


def num_params(tree: Any) -> int:
    """Number of scalars in the array leaves of `tree`."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def make_step(optimizer: optax.GradientTransformation, loss: Loss) -> Callable[..., Any]:
    """The (unjitted) training step `(model, opt_state, batch) -> (model, opt_state, loss)`."""

    def step(model: Any, opt_state: Any, batch: Any) -> Any:
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    return step


# --------------------------------------------------------------------------- the MLP

def make_mlp(width: int, depth: int, features: int, seed: int) -> eqx.nn.MLP:
    """An MLP `features -> width x depth -> features`; `depth` hidden layers."""
    return eqx.nn.MLP(features, features, width, depth, key=jax.random.key(seed))


def mlp_shape(n: float) -> tuple[int, int]:
    """`(width, depth)` of a square MLP (`make_mlp(width, depth, width, seed)`) with
    about `n` parameters: `(depth + 1) * (width**2 + width)`; width a power of two up to
    4096, at least 4 layers where the size allows."""
    width = int(2 ** np.floor(np.log2(np.sqrt(max(n, 64) / 4))))
    width = max(8, min(width, 4096))
    layers = max(2, round(n / (width * width + width)))
    return width, layers - 1


def regression_batches(features: int, batch: int, batches: int, seed: int) -> list[Any]:
    """A synthetic regression task: `batches` batches `(x, y)` of `batch` examples, `y`
    the output of a fixed random teacher (a smooth nonlinear map) on `x`."""
    kx, kw = jax.random.split(jax.random.key(seed + 1))
    xs = jax.random.normal(kx, (batches, batch, features))
    teacher = jax.random.normal(kw, (features, features)) / np.sqrt(features)
    ys = jnp.tanh(xs @ teacher)
    return [(xs[i], ys[i]) for i in range(batches)]


def mse_loss(model: Any, batch: Any) -> jax.Array:
    """Mean squared error of `model` on one batch `(x, y)`."""
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


# --------------------------------------------------------------------------- the transformer LM

@dataclasses.dataclass(frozen=True)
class LMShape:
    """The size of `TransformerLM` and of its batches."""

    vocab: int = 4096
    width: int = 256
    layers: int = 4
    heads: int = 4
    seq: int = 128
    batch: int = 8

    @property
    def params(self) -> int:
        """Number of parameters (embeddings, blocks, final norm and unembedding)."""
        d = self.width
        block = 4 * d * d + 4 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
        return (self.vocab + self.seq) * d + self.layers * block + 2 * d + d * self.vocab

    @property
    def tokens(self) -> int:
        """Tokens per batch."""
        return self.batch * self.seq


class Block(eqx.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU MLP."""

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, heads: int, key: jax.Array) -> None:
        ka, ku, kd = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=ka)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.up = eqx.nn.Linear(width, 4 * width, key=ku)
        self.down = eqx.nn.Linear(4 * width, width, key=kd)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


class TransformerLM(eqx.Module):
    """A small decoder-only language model: token and learned position embeddings,
    `layers` pre-norm blocks, a final layer norm and an unembedding. Called on one
    sequence of token ids `[seq]`, returns next-token logits `[seq, vocab]`."""

    embed: eqx.nn.Embedding
    position: eqx.nn.Embedding
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, shape: LMShape, key: jax.Array) -> None:
        ke, kp, ku, *kb = jax.random.split(key, 3 + shape.layers)
        self.embed = eqx.nn.Embedding(shape.vocab, shape.width, key=ke)
        self.position = eqx.nn.Embedding(shape.seq, shape.width, key=kp)
        self.blocks = [Block(shape.width, shape.heads, k) for k in kb]
        self.norm = eqx.nn.LayerNorm(shape.width)
        self.unembed = eqx.nn.Linear(shape.width, shape.vocab, use_bias=False, key=ku)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        seq = tokens.shape[0]
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.position)(jnp.arange(seq))
        mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.unembed)(jax.vmap(self.norm)(x))


def make_lm(shape: LMShape, seed: int) -> TransformerLM:
    """A fresh `TransformerLM` of `shape`."""
    return TransformerLM(shape, jax.random.key(seed))


SUCCESSORS = 4
"""Each token of the synthetic language has this many equally likely successors, so the
best possible loss is `log(SUCCESSORS)` nats per token."""


def token_batches(shape: LMShape, batches: int, seed: int) -> list[jax.Array]:
    """Synthetic token sequences `[batch, seq]` (int32) from a fixed random Markov chain:
    the token after `t` is `successor[t] + k (mod vocab)` with `k` uniform in
    `[0, SUCCESSORS)`, so a model can learn it down to `log(SUCCESSORS)` nats."""
    k_perm, k_start, k_steps = jax.random.split(jax.random.key(seed + 1), 3)
    successor = jax.random.permutation(k_perm, shape.vocab).astype(jnp.int32)
    start = jax.random.randint(k_start, (batches, shape.batch), 0, shape.vocab, jnp.int32)
    jumps = jax.random.randint(k_steps, (shape.seq - 1, batches, shape.batch), 0, SUCCESSORS,
                               jnp.int32)

    def next_token(t: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        t = (successor[t] + k) % shape.vocab
        return t, t

    _, rest = jax.lax.scan(next_token, start, jumps)
    tokens = jnp.concatenate([start[None], rest], axis=0)  # [seq, batches, batch]
    tokens = jnp.transpose(tokens, (1, 2, 0))
    return [tokens[i] for i in range(batches)]


def lm_loss(model: Any, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (nats) of `model` on a batch `[batch, seq]`."""
    logits = jax.vmap(model)(tokens)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1], tokens[:, 1:]))


# --------------------------------------------------------------------------- workloads

@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its loss and its data, as the benchmark trains them.

    **Fields:**

    - `name`: `"mlp"` or `"transformer"`.
    - `shape`: the numbers that size it, for the tables (`width`, `depth`, ...).
    - `make_model`: `seed -> model`, a fresh model.
    - `batches`: `(count, seed) -> list of batches`.
    - `loss`: `(model, batch) -> scalar`.
    """

    name: str
    shape: dict[str, int]
    make_model: Callable[[int], Any]
    batches: Callable[[int, int], Sequence[Any]]
    loss: Loss


def mlp_workload(n: float, batch: int) -> Workload:
    """A square MLP of about `n` parameters on the regression task, batches of `batch`."""
    width, depth = mlp_shape(n)
    return Workload(
        name="mlp",
        shape={"width": width, "depth": depth, "batch": batch},
        make_model=lambda seed: make_mlp(width, depth, width, seed),
        batches=lambda count, seed: regression_batches(width, batch, count, seed),
        loss=mse_loss,
    )


def lm_workload(shape: LMShape) -> Workload:
    """`TransformerLM(shape)` on the synthetic Markov language."""
    return Workload(
        name="transformer",
        shape=dataclasses.asdict(shape),
        make_model=lambda seed: make_lm(shape, seed),
        batches=lambda count, seed: token_batches(shape, count, seed),
        loss=lm_loss,
    )

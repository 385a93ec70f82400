"""A GRU over `lax.scan`, trained to classify sequences (Equinox's RNN style)."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqx_offload  # (1) the import

from .common import batches, params, Recorder, Run


STEPS = 5
SEQ_LEN, FEATURES, HIDDEN, BATCH = 12, 2, 16, 32


class RNN(eqx.Module):
    hidden_size: int = eqx.field(static=True)
    cell: eqx.nn.GRUCell
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, in_size: int, out_size: int, hidden_size: int, *, key: jax.Array):
        ckey, lkey = jr.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=ckey)
        self.linear = eqx.nn.Linear(hidden_size, out_size, use_bias=False, key=lkey)
        self.bias = jnp.zeros(out_size)

    def __call__(self, xs: jax.Array) -> jax.Array:
        def scan_fn(state, x):
            return self.cell(x, state), None

        hidden = jnp.zeros((self.hidden_size,))
        out, _ = lax.scan(scan_fn, hidden, xs)
        return jax.nn.sigmoid(self.linear(out) + self.bias)


def label(xs: jax.Array) -> jax.Array:
    return (jnp.sum(xs[:, :, 0], axis=1) > 0).astype(jnp.float32)[:, None]


def train(port: bool, donate: str = "none") -> Run:
    model = RNN(FEATURES, 1, HIDDEN, key=jr.key(0))
    optim = optax.adam(3e-3)
    if port:
        optim = eqx_offload.offloaded(optim)  # (2) offloaded around the optimizer
    jit = eqx_offload.filter_jit if port else eqx.filter_jit  # (3) its filter_jit
    opt_state = optim.init(params(model))

    @eqx.filter_value_and_grad
    def compute_loss(model, x, y):
        pred = jax.vmap(model)(x)
        return -jnp.mean(y * jnp.log(pred) + (1 - y) * jnp.log(1 - pred))

    @jit(donate=donate)
    def make_step(model, x, y, opt_state):
        loss, grads = compute_loss(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, params(model))
        model = eqx.apply_updates(model, updates)
        return loss, model, opt_state

    recorder = Recorder(port)
    for x, y in batches(jr.key(1), STEPS, (BATCH, SEQ_LEN, FEATURES), label):
        with recorder.step():
            loss, model, opt_state = make_step(model, x, y, opt_state)
        recorder.record(loss, opt_state)
    return recorder.run(model, opt_state)

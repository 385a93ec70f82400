"""A stateful model: `eqx.nn.BatchNorm` with `eqx.nn.State`, built with
`eqx.nn.make_with_state` (Equinox's stateful-layers style), evaluated in inference mode."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqx_offload  # (1) the import

from .common import batches, params, Recorder, Run


STEPS = 5
IN, WIDTH, OUT, BATCH = 4, 16, 2, 32


class Model(eqx.Module):
    linear1: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    linear2: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        key1, key2 = jr.split(key)
        self.linear1 = eqx.nn.Linear(IN, WIDTH, key=key1)
        self.norm = eqx.nn.BatchNorm(input_size=WIDTH, axis_name="batch", mode="batch")
        self.linear2 = eqx.nn.Linear(WIDTH, OUT, key=key2)

    def __call__(self, x: jax.Array, state: eqx.nn.State) -> tuple[jax.Array, eqx.nn.State]:
        x = self.linear1(x)
        x, state = self.norm(x, state)
        x = jax.nn.relu(x)
        return self.linear2(x), state


def compute_loss(model, state, x, y):
    batch_model = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    pred, state = batch_model(x, state)
    return jnp.mean((pred - y) ** 2), state


def train(port: bool, donate: str = "none") -> Run:
    model, state = eqx.nn.make_with_state(Model)(jr.key(0))
    optim = optax.adamw(1e-2, weight_decay=1e-3)
    if port:
        optim = eqx_offload.offloaded(optim)  # (2)
    jit = eqx_offload.filter_jit if port else eqx.filter_jit  # (3)
    opt_state = optim.init(params(model))

    @jit(donate=donate)
    def make_step(model, state, opt_state, x, y):
        grad_fn = eqx.filter_value_and_grad(compute_loss, has_aux=True)
        (loss, state), grads = grad_fn(model, state, x, y)
        updates, opt_state = optim.update(grads, opt_state, params(model))
        model = eqx.apply_updates(model, updates)
        return model, state, opt_state, loss

    recorder = Recorder(port)
    data = batches(jr.key(1), STEPS, (BATCH, IN), transform=lambda x: 3.0 * x + 1.0)
    for x, y in data:
        with recorder.step():
            model, state, opt_state, loss = make_step(model, state, opt_state, x, y)
        recorder.record(loss, opt_state)

    # Evaluation: running statistics, no state update.
    inference_model = eqx.nn.inference_mode(model)
    x, y = data[0]
    eval_loss, _ = jit(compute_loss)(inference_model, state, x, y)
    return recorder.run(model, opt_state, extra=(state, eval_loss))

"""Equinox's MNIST (CNN) example, in small: `optax.adamw`, a `make_step` under
`eqx.filter_jit`, and the example's jitted evaluations (`compute_accuracy`, `loss`) before
training and after every step, which stay under `eqx.filter_jit` when ported."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqx_offload  # (1) the import

from helpers import count_compiles

from .common import params, Recorder, Run


STEPS = 5
BATCH, SIDE, CLASSES = 16, 8, 4


class CNN(eqx.Module):
    layers: list

    def __init__(self, key: jax.Array):
        key1, key2, key3 = jr.split(key, 3)
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=3, key=key1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(3 * 5 * 5, 16, key=key2),
            jax.nn.sigmoid,
            eqx.nn.Linear(16, CLASSES, key=key3),
            jax.nn.log_softmax,
        ]

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


def loss(model: CNN, x: jax.Array, y: jax.Array) -> jax.Array:
    pred_y = jax.vmap(model)(x)
    return -jnp.mean(jnp.take_along_axis(pred_y, jnp.expand_dims(y, 1), axis=1))


def compute_accuracy(model: CNN, x: jax.Array, y: jax.Array) -> jax.Array:
    pred_y = jnp.argmax(jax.vmap(model)(x), axis=1)
    return jnp.mean(y == pred_y)


def data(key: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    out = []
    for k in jr.split(key, STEPS):
        kx, ky = jr.split(k)
        out.append((jr.normal(kx, (BATCH, 1, SIDE, SIDE)), jr.randint(ky, (BATCH,), 0, CLASSES)))
    return out


def train(port: bool, donate: str = "none", commit: bool = True) -> Run:
    """`commit`: the docs' one-line remedy ("Equinox training loop") for the user's other
    jitted functions: the model committed before the first call, as after a step."""
    model = CNN(jr.key(0))
    if port and commit:
        model = eqx_offload.filter_shard(model, jax.sharding.make_single_device_sharding(jax.devices()[0]))
    optim = optax.adamw(3e-3)
    if port:
        optim = eqx_offload.offloaded(optim)  # (2)
    jit = eqx_offload.filter_jit if port else eqx.filter_jit  # (3)
    opt_state = optim.init(params(model))
    # The example's `@eqx.filter_jit` evaluations (fresh per run: each counts its own).
    eval_loss = eqx.filter_jit(lambda model, x, y: loss(model, x, y))
    accuracy = eqx.filter_jit(lambda model, x, y: compute_accuracy(model, x, y))

    @jit(donate=donate)
    def make_step(model, opt_state, x, y):
        loss_value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, params(model))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss_value

    recorder = Recorder(port)
    batches = data(jr.key(1))
    x_test, y_test = batches[0]
    evaluations = []
    eval_compiles: list[str] = []
    with count_compiles() as compiled:
        evaluations.append((eval_loss(model, x_test, y_test), accuracy(model, x_test, y_test)))
    eval_compiles += compiled
    for x, y in batches:
        with recorder.step():
            model, opt_state, train_loss = make_step(model, opt_state, x, y)
        recorder.record(train_loss, opt_state)
        with count_compiles() as compiled:
            evaluations.append((eval_loss(model, x_test, y_test),
                                accuracy(model, x_test, y_test)))
        eval_compiles += compiled
    return recorder.run(model, opt_state, extra=(evaluations, len(eval_compiles)))

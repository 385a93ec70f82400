"""Optax's meta-learning example (`examples/meta_learning.ipynb`): the learning rate of
`inject_hyperparams(optax.rmsprop)` learned by `jax.grad` through several inner
updates, the hyperparameter written into the state (`state.hyperparams[...] =
jax.nn.sigmoid(eta)`), the outer step under a jit. Ported: the import and
`offloaded(..., where=True)` (the example's `theta` is a scalar, whose state the default
`where` would leave on the device: every leaf in host memory); the jit is the program's own (`jax.jit`),
`eqx_offload.jit` or `eqx_offload.filter_jit` in place of `eqx.filter_jit`.
"""

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_offload  # (1) the import

from .common import Recorder, Run


STEPS = 6
N = 7  # samples per outer step: N - 1 inner updates, then the outer loss


def generator() -> Iterator[tuple[jax.Array, jax.Array]]:
    rng = jax.random.PRNGKey(0)
    while True:
        rng, k1, k2 = jax.random.split(rng, num=3)
        x = jax.random.uniform(k1, minval=0.0, maxval=10.0)
        y = 10.0 * x + jax.random.normal(k2)
        yield x, y


def f(theta: jax.Array, x: jax.Array) -> jax.Array:
    return x * theta


JITS = {  # the ported program's jit: (plain, ported)
    "jax.jit": (jax.jit, jax.jit),
    "eqx_offload.jit": (jax.jit, eqx_offload.jit),
    "filter_jit": (eqx.filter_jit, eqx_offload.filter_jit),
}


def train(port: bool, jit_name: str = "jax.jit") -> Run:
    """The example, `STEPS` outer steps; `losses` are the `theta`s."""
    jit = JITS[jit_name][port]
    init_learning_rate = jnp.array(0.1)
    meta_learning_rate = jnp.array(0.03)
    opt = optax.inject_hyperparams(optax.rmsprop)(learning_rate=init_learning_rate)
    if port:
        opt = eqx_offload.offloaded(opt, where=True)  # (2)
    meta_opt = optax.adam(learning_rate=meta_learning_rate)

    def loss(theta: Any, x: Any, y: Any) -> Any:
        return optax.l2_loss(y, f(theta, x))

    def step(theta: Any, state: Any, x: Any, y: Any) -> Any:
        grad = jax.grad(loss)(theta, x, y)
        updates, state = opt.update(grad, state)
        theta = optax.apply_updates(theta, updates)
        return theta, state

    @jit
    def outer_loss(eta: Any, theta: Any, state: Any, samples: Any) -> Any:
        state.hyperparams["learning_rate"] = jax.nn.sigmoid(eta)
        for x, y in samples[:-1]:
            theta, state = step(theta, state, x, y)
        x, y = samples[-1]
        return loss(theta, x, y), (theta, state)

    @jit
    def outer_step(eta: Any, theta: Any, meta_state: Any, state: Any, samples: Any) -> Any:
        grad, (theta, state) = jax.grad(outer_loss, has_aux=True)(eta, theta, state, samples)
        meta_updates, meta_state = meta_opt.update(grad, meta_state)
        eta = optax.apply_updates(eta, meta_updates)
        return eta, theta, meta_state, state

    theta = jax.random.normal(jax.random.PRNGKey(1))
    state = opt.init(theta)
    eta = -np.log(1.0 / init_learning_rate - 1)
    meta_state = meta_opt.init(eta)
    g = generator()
    recorder = Recorder(port)
    learning_rates = []
    for _ in range(STEPS):
        samples = [next(g) for _ in range(N)]
        with recorder.step():
            eta, theta, meta_state, state = outer_step(eta, theta, meta_state, state, samples)
        learning_rates.append(jax.nn.sigmoid(eta))
        recorder.record(theta, state)
    return recorder.run(theta, state, extra=(learning_rates, meta_state))

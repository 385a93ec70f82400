"""Optax's schedule-free training, as its notebook writes it: `schedule_free_adamw`
trains the parameters `y`; evaluation uses `schedule_free_eval_params(state, params)`,
a function of its own under `jax.jit` that reads the optimizer state. At the end the
evaluation model is itself the jitted function (`filter_jit(eval_model)(x)`).

Ported: the three lines; the evaluation reads the `OffloadedState` itself, whose leaves
come to the device as they are read (a `jax.jit` reading its `inner_state` would get
JAX's memory-space error: docs/how-to/port.md); the final evaluation is
`eqx_offload.filter_jit(eval_model)`, which traces the model's arrays."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqx_offload

from .common import batches, params, Recorder, Run


STEPS = 6
BATCH = 32


def _loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def train(port: bool) -> Run:
    model = eqx.nn.MLP(3, 2, 32, 2, activation=jax.nn.tanh, key=jr.key(0))
    optimizer = optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2)
    if port:
        optimizer = eqx_offload.offloaded(optimizer)
    jit = eqx_offload.filter_jit if port else eqx.filter_jit
    opt_state = optimizer.init(params(model))

    @jit(donate="all-except-first")
    def step(data: Any, model: Any, opt_state: Any) -> Any:
        loss, grads = eqx.filter_value_and_grad(_loss)(model, *data)
        updates, opt_state = optimizer.update(grads, opt_state, params(model))
        return loss, eqx.apply_updates(model, updates), opt_state

    eval_params = jax.jit(optax.contrib.schedule_free_eval_params)
    x_test, y_test = batches(jr.key(2), 1, (BATCH, 3))[0]
    recorder, evaluations = Recorder(port), []
    for data in batches(jr.key(1), STEPS, (BATCH, 3)):
        with recorder.step():
            loss, model, opt_state = step(data, model, opt_state)
        recorder.record(loss, opt_state)
        eval_model = eqx.combine(eval_params(opt_state, params(model)), model)
        evaluations.append(_loss(eval_model, x_test, y_test))
    predictions = jit(eval_model)(x_test[0])  # the model as the jitted function
    return recorder.run(model, opt_state, (evaluations, predictions))

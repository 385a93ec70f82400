"""Fine-tuning with frozen layers, two ways: `partition` (Equinox's frozen-layer example:
a filter spec, `eqx.partition` inside the loss, the optimizer sees the trainable part) and
`multi_transform` (the whole model, `optax.set_to_zero()` for the frozen label)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import optax

import eqx_offload  # (1) the import

from .common import batches, Recorder, Run


STEPS = 5
BATCH = 32


def make_model() -> eqx.nn.MLP:
    return eqx.nn.MLP(3, 2, 16, 3, activation=jax.nn.softplus, key=jr.key(0))


def trainable(model: eqx.nn.MLP) -> eqx.nn.MLP:
    """True for the last layer's weight and bias, False elsewhere."""
    spec = jtu.tree_map(lambda _: False, model)
    return eqx.tree_at(lambda m: (m.layers[-1].weight, m.layers[-1].bias), spec,
                       replace=(True, True))


def fit(port: bool, make_step: Any, model: eqx.nn.MLP, opt_state: Any) -> Run:
    """The training loop of both programs."""
    recorder = Recorder(port)
    for x, y in batches(jr.key(1), STEPS, (BATCH, 3),
                        lambda x: jnp.stack([x[:, 0] * x[:, 1], jnp.cos(x[:, 2])], axis=1)):
        with recorder.step():
            loss, model, opt_state = make_step(model, x, y, opt_state)
        recorder.record(loss, opt_state)
    return recorder.run(model, opt_state)


def _loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def train_partition(port: bool, donate: str = "none") -> Run:
    model = make_model()
    filter_spec = trainable(model)
    optim = optax.adabelief(1e-2)
    if port:
        optim = eqx_offload.offloaded(optim)  # (2)
    jit = eqx_offload.filter_jit if port else eqx.filter_jit  # (3)
    opt_state = optim.init(eqx.filter(model, filter_spec))

    @eqx.filter_value_and_grad
    def compute_loss(diff_model, static_model, x, y):
        return _loss(eqx.combine(diff_model, static_model), x, y)

    @jit(donate=donate)
    def make_step(model, x, y, opt_state):
        diff_model, static_model = eqx.partition(model, filter_spec)
        loss, grads = compute_loss(diff_model, static_model, x, y)
        updates, opt_state = optim.update(grads, opt_state, diff_model)
        model = eqx.apply_updates(model, updates)
        return loss, model, opt_state

    return fit(port, make_step, model, opt_state)


def train_multi_transform(port: bool, donate: str = "none") -> Run:
    model = make_model()
    params = eqx.filter(model, eqx.is_array)
    # "train"/"freeze" for each array, None where `params` has None.
    labels = jtu.tree_map(
        lambda leaf, spec: ("train" if spec else "freeze") if eqx.is_array(leaf) else None,
        model, trainable(model))
    # A model is callable, so its labels go in a function (optax would call them).
    optim = optax.multi_transform({"train": optax.adam(1e-2), "freeze": optax.set_to_zero()},
                                  lambda _: labels)
    if port:
        optim = eqx_offload.offloaded(optim)  # (2)
    jit = eqx_offload.filter_jit if port else eqx.filter_jit  # (3)
    opt_state = optim.init(params)

    @jit(donate=donate)
    def make_step(model, x, y, opt_state):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return loss, model, opt_state

    return fit(port, make_step, model, opt_state)

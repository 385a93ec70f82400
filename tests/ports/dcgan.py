"""Equinox's DCGAN example, in small: a generator and a discriminator with
`eqx.nn.BatchNorm`, each with its `eqx.nn.State(model)` (which shares arrays with the
model: the state's initial running statistics are the model's own arrays), two adam
optimizers, and one jitted step that updates both, donating everything
(`donate="all"`, the README's recipe)."""

import functools
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqx_offload  # (1) the import

from .common import fresh_copy, Recorder, Run


STEPS = 5
LATENT, FEATURES, BATCH = 4, 6, 16


class Generator(eqx.Module):
    linear1: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    linear2: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2 = jr.split(key)
        self.linear1 = eqx.nn.Linear(LATENT, 8, key=k1)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.linear2 = eqx.nn.Linear(8, FEATURES, key=k2)

    def __call__(self, z, state):
        x, state = self.norm(jax.nn.relu(self.linear1(z)), state)
        return jnp.tanh(self.linear2(x)), state


class Discriminator(eqx.Module):
    linear1: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    linear2: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2 = jr.split(key)
        self.linear1 = eqx.nn.Linear(FEATURES, 8, key=k1)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.linear2 = eqx.nn.Linear(8, 1, key=k2)

    def __call__(self, x, state):
        x, state = self.norm(jax.nn.leaky_relu(self.linear1(x)), state)
        return self.linear2(x), state


def params(model):
    return eqx.filter(model, eqx.is_inexact_array)  # (the example's filter)


def _batched(model, inputs, state):
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(inputs, state)


def discriminator_loss(discriminator, discriminator_state, fake, real):
    fake_logits, discriminator_state = _batched(discriminator, fake, discriminator_state)
    real_logits, discriminator_state = _batched(discriminator, real, discriminator_state)
    loss = (jnp.mean(optax.sigmoid_binary_cross_entropy(fake_logits, jnp.zeros_like(fake_logits)))
            + jnp.mean(optax.sigmoid_binary_cross_entropy(real_logits, jnp.ones_like(real_logits))))
    return loss, discriminator_state


def generator_loss(generator, generator_state, discriminator, discriminator_state, z):
    fake, generator_state = _batched(generator, z, generator_state)
    logits, discriminator_state = _batched(discriminator, fake, discriminator_state)
    loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, jnp.ones_like(logits)))
    return loss, (generator_state, discriminator_state)


def data(key: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    out = []
    for k in jr.split(key, STEPS):
        kz, kr = jr.split(k)
        real = jnp.sin(jr.normal(kr, (BATCH, FEATURES)) + 1.0)
        out.append((jr.normal(kz, (BATCH, LATENT)), real))
    return out


@functools.cache
def _models() -> tuple[Generator, Discriminator]:
    return Generator(jr.key(0)), Discriminator(jr.key(1))


def models() -> tuple[Generator, Discriminator]:
    return fresh_copy(_models())


def train(port: bool, donate: str = "all", deleted: Optional[list[bool]] = None) -> Run:
    """`deleted`, if given, receives per step whether every array passed to the step
    was consumed (donated) by it."""
    generator, discriminator = models()
    generator_state = eqx.nn.State(generator)  # shares arrays with `generator`
    discriminator_state = eqx.nn.State(discriminator)
    generator_optim = optax.adam(2e-3, b1=0.5)
    discriminator_optim = optax.adam(2e-3, b1=0.5)
    if port:
        generator_optim = eqx_offload.offloaded(generator_optim)  # (2)
        discriminator_optim = eqx_offload.offloaded(discriminator_optim)
    jit = eqx_offload.filter_jit if port else eqx.filter_jit  # (3)
    generator_opt_state = generator_optim.init(params(generator))
    discriminator_opt_state = discriminator_optim.init(params(discriminator))

    @jit(donate=donate)
    def step(generator, discriminator, generator_opt_state, discriminator_opt_state,
             generator_state, discriminator_state, z, real):
        (g_loss, (generator_state, discriminator_state)), grads = eqx.filter_value_and_grad(
            generator_loss, has_aux=True)(generator, generator_state, discriminator,
                                          discriminator_state, z)
        updates, generator_opt_state = generator_optim.update(grads, generator_opt_state,
                                                              params(generator))
        generator = eqx.apply_updates(generator, updates)
        fake, _ = _batched(generator, z, generator_state)
        (d_loss, discriminator_state), grads = eqx.filter_value_and_grad(
            discriminator_loss, has_aux=True)(discriminator, discriminator_state,
                                              jax.lax.stop_gradient(fake), real)
        updates, discriminator_opt_state = discriminator_optim.update(
            grads, discriminator_opt_state, params(discriminator))
        discriminator = eqx.apply_updates(discriminator, updates)
        return (generator, discriminator, generator_opt_state, discriminator_opt_state,
                generator_state, discriminator_state, g_loss + d_loss)

    recorder = Recorder(port)
    for z, real in data(jr.key(2)):
        before = jax.tree.leaves((generator, discriminator, generator_opt_state,
                                  discriminator_opt_state, generator_state,
                                  discriminator_state))
        with recorder.step():
            (generator, discriminator, generator_opt_state, discriminator_opt_state,
             generator_state, discriminator_state, loss) = step(
                generator, discriminator, generator_opt_state, discriminator_opt_state,
                generator_state, discriminator_state, z, real)
        recorder.record(loss, (generator_opt_state, discriminator_opt_state))
        if deleted is not None:
            deleted.append(all(x.is_deleted() for x in before if isinstance(x, jax.Array)))
    return recorder.run((generator, discriminator),
                        (generator_opt_state, discriminator_opt_state),
                        extra=(generator_state, discriminator_state))

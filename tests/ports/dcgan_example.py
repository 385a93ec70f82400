"""Equinox's DCGAN example as written (docs/examples/deep_convolutional_gan.ipynb), in
small: convolutional generator and discriminator with `eqx.nn.BatchNorm` (its default
`mode="ema"` written out) and `eqx.nn.PReLU`, each with its `eqx.nn.State(model)`, two adam
optimizers passed as arguments to two jitted steps per iteration (each returns the other
model's state but not the other model), a PRNG key carried through both, numpy images in.
`one_step=True` (`dcgan.py`) folds the two steps into one jitted step."""

import functools
from collections.abc import Callable
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import eqx_offload  # (1) the import

from .common import fresh_copy, Recorder, Run


STEPS = 4
BATCH, LATENT, FEATURES = 4, 8, 4
IMAGE = (64, 64, 1)
# The example's `eqx.nn.PReLU(0.2)` makes weakly typed slopes that the first update
# returns strongly typed (a recompilation, plain as ported); float32 compiles once.
SLOPE = jnp.float32(0.2)


class Generator(eqx.Module):
    layers: list[eqx.nn.ConvTranspose2d | eqx.nn.BatchNorm | Callable]

    def __init__(self, input_shape: int, output_shape: tuple[int, int, int], key):
        keys = jr.split(key, 5)
        height, width, channels = output_shape
        f = FEATURES
        conv = dict(kernel_size=4, stride=2, padding=1, use_bias=False)
        self.layers = [
            eqx.nn.ConvTranspose2d(input_shape, f * 8, kernel_size=4, stride=1, padding=0,
                                   use_bias=False, key=keys[0]),
            eqx.nn.BatchNorm(input_size=f * 8, axis_name="batch", mode="ema"),
            jax.nn.relu,
            eqx.nn.ConvTranspose2d(f * 8, f * 4, **conv, key=keys[1]),
            eqx.nn.BatchNorm(input_size=f * 4, axis_name="batch", mode="ema"),
            jax.nn.relu,
            eqx.nn.ConvTranspose2d(f * 4, f * 2, **conv, key=keys[2]),
            eqx.nn.BatchNorm(input_size=f * 2, axis_name="batch", mode="ema"),
            jax.nn.relu,
            eqx.nn.ConvTranspose2d(f * 2, f, **conv, key=keys[3]),
            eqx.nn.BatchNorm(input_size=f, axis_name="batch", mode="ema"),
            jax.nn.relu,
            eqx.nn.ConvTranspose2d(f, channels, **conv, key=keys[4]),
            jax.nn.tanh,
        ]

    def __call__(self, x, state):
        for layer in self.layers:
            if isinstance(layer, eqx.nn.BatchNorm):
                x, state = layer(x, state)
            else:
                x = layer(x)
        return x, state


class Discriminator(eqx.Module):
    layers: list[eqx.nn.Conv2d | eqx.nn.PReLU | eqx.nn.BatchNorm | Callable]

    def __init__(self, input_shape: tuple[int, int, int], key):
        keys = jr.split(key, 5)
        height, width, channels = input_shape
        f = FEATURES
        conv = dict(kernel_size=4, stride=2, padding=1, use_bias=False)
        self.layers = [
            eqx.nn.Conv2d(channels, f, **conv, key=keys[0]),
            eqx.nn.PReLU(SLOPE),
            eqx.nn.Conv2d(f, f * 2, **conv, key=keys[1]),
            eqx.nn.BatchNorm(f * 2, axis_name="batch", mode="ema"),
            eqx.nn.PReLU(SLOPE),
            eqx.nn.Conv2d(f * 2, f * 4, **conv, key=keys[2]),
            eqx.nn.BatchNorm(f * 4, axis_name="batch", mode="ema"),
            eqx.nn.PReLU(SLOPE),
            eqx.nn.Conv2d(f * 4, f * 8, **conv, key=keys[3]),
            eqx.nn.BatchNorm(f * 8, axis_name="batch", mode="ema"),
            eqx.nn.PReLU(SLOPE),
            eqx.nn.Conv2d(f * 8, 1, kernel_size=4, stride=1, padding=0, use_bias=False,
                          key=keys[4]),
        ]

    def __call__(self, x, state):
        for layer in self.layers:
            if isinstance(layer, eqx.nn.BatchNorm):
                x, state = layer(x, state=state)
            else:
                x = layer(x)
        return x, state


def _vmap(model):
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))


@eqx.filter_value_and_grad(has_aux=True)
def compute_grads_discriminator(discriminator, generator, fake_labels, real_batch,
                                real_labels, discriminator_state, generator_state, key):
    key, subkey = jr.split(key)
    noise = jr.normal(subkey, (BATCH, LATENT, 1, 1))
    fake_batch, generator_state = _vmap(generator)(noise, generator_state)
    pred_y, discriminator_state = _vmap(discriminator)(fake_batch, discriminator_state)
    loss1 = optax.sigmoid_binary_cross_entropy(pred_y, fake_labels).mean()
    pred_y, discriminator_state = _vmap(discriminator)(real_batch, discriminator_state)
    loss2 = optax.sigmoid_binary_cross_entropy(pred_y, real_labels).mean()
    loss = (loss1 + loss2) / 2
    return loss, (discriminator_state, generator_state, key)


@eqx.filter_value_and_grad(has_aux=True)
def compute_grads_generator(generator, discriminator, real_labels, discriminator_state,
                            generator_state, key):
    key, subkey = jr.split(key)
    noise = jr.normal(subkey, (BATCH, LATENT, 1, 1))
    fake_batch, generator_state = _vmap(generator)(noise, generator_state)
    pred_y, discriminator_state = _vmap(discriminator)(fake_batch, discriminator_state)
    loss = optax.sigmoid_binary_cross_entropy(pred_y, real_labels).mean()
    return loss, (discriminator_state, generator_state, key)


def _step_discriminator(discriminator, generator, real_batch, discriminator_optimizer,
                        discriminator_opt_state, generator_state, discriminator_state, key):
    fake_labels = jnp.zeros(BATCH)
    real_labels = jnp.ones(BATCH)
    (loss, (discriminator_state, generator_state, key)), grads = compute_grads_discriminator(
        discriminator, generator, fake_labels, real_batch, real_labels, discriminator_state,
        generator_state, key)
    updates, opt_state = discriminator_optimizer.update(grads, discriminator_opt_state)
    discriminator = eqx.apply_updates(discriminator, updates)
    return loss, discriminator, opt_state, generator_state, discriminator_state, key


def _step_generator(generator, discriminator, generator_optimizer, generator_opt_state,
                    discriminator_state, generator_state, key):
    real_labels = jnp.ones(BATCH)
    (loss, (discriminator_state, generator_state, key)), grads = compute_grads_generator(
        generator, discriminator, real_labels, discriminator_state, generator_state, key)
    updates, opt_state = generator_optimizer.update(grads, generator_opt_state)
    generator = eqx.apply_updates(generator, updates)
    return loss, generator, opt_state, discriminator_state, generator_state, key


@functools.cache
def _models() -> tuple[jax.Array, Generator, Discriminator]:
    key = jr.PRNGKey(2003)
    key, gen_key, disc_key = jr.split(key, 3)
    generator = Generator(input_shape=LATENT, output_shape=IMAGE, key=gen_key)
    discriminator = Discriminator(input_shape=IMAGE, key=disc_key)
    return key, generator, discriminator


def models() -> tuple[jax.Array, Generator, Discriminator]:
    return fresh_copy(_models())


def images(key: jax.Array) -> list[np.ndarray]:
    """The data loader's batches as numpy arrays (the example's `images.numpy()`)."""
    return [np.asarray(jnp.tanh(jr.normal(k, (BATCH, IMAGE[2], IMAGE[0], IMAGE[1]))))
            for k in jr.split(key, STEPS)]


def train(port: bool, donate: str = "none", deleted: Optional[list[bool]] = None,
          one_step: bool = False) -> Run:
    """`donate`: as `eqx.filter_jit`'s, or `"returned"` (ported only): each step donates by
    name what it returns. `deleted`, if given, receives per iteration whether every array
    passed to the steps was consumed."""
    key, generator, discriminator = models()
    generator_state = eqx.nn.State(generator)
    discriminator_state = eqx.nn.State(discriminator)
    generator_optimizer = optax.adam(2e-4, b1=0.5, b2=0.999)
    discriminator_optimizer = optax.adam(2e-4, b1=0.5, b2=0.999)
    if port:
        generator_optimizer = eqx_offload.offloaded(generator_optimizer)  # (2)
        discriminator_optimizer = eqx_offload.offloaded(discriminator_optimizer)
    jit = eqx_offload.filter_jit if port else eqx.filter_jit  # (3)
    if one_step:
        step_discriminator, step_generator = _step_discriminator, _step_generator
    elif donate == "returned":  # (eqx_offload.filter_jit only)
        step_discriminator = jit(_step_discriminator, donate=(
            "discriminator", "discriminator_opt_state", "generator_state",
            "discriminator_state", "key"))
        step_generator = jit(_step_generator, donate=(
            "generator", "generator_opt_state", "discriminator_state", "generator_state",
            "key"))
    else:
        step_discriminator = jit(_step_discriminator, donate=donate)
        step_generator = jit(_step_generator, donate=donate)
    # (The example filters with `eqx.is_array`; this Equinox's `BatchNorm` holds a bool
    # array that gets no gradient, which plain optax fails on as the port does.)
    generator_opt_state = generator_optimizer.init(eqx.filter(generator, eqx.is_inexact_array))
    discriminator_opt_state = discriminator_optimizer.init(
        eqx.filter(discriminator, eqx.is_inexact_array))

    def iteration(generator, discriminator, generator_opt_state, discriminator_opt_state,
                  generator_state, discriminator_state, batch, key):
        (discriminator_loss, discriminator, discriminator_opt_state, generator_state,
         discriminator_state, key) = step_discriminator(
            discriminator, generator, batch, discriminator_optimizer,
            discriminator_opt_state, generator_state, discriminator_state, key)
        (generator_loss, generator, generator_opt_state, discriminator_state,
         generator_state, key) = step_generator(
            generator, discriminator, generator_optimizer, generator_opt_state,
            discriminator_state, generator_state, key)
        return (generator, discriminator, generator_opt_state, discriminator_opt_state,
                generator_state, discriminator_state, key, discriminator_loss, generator_loss)

    if one_step:
        iteration = jit(iteration, donate=donate)
    recorder = Recorder(port)
    for batch in images(jr.key(7)):
        before = jax.tree.leaves((generator, discriminator, generator_opt_state,
                                  discriminator_opt_state, generator_state,
                                  discriminator_state, key))
        with recorder.step():
            (generator, discriminator, generator_opt_state, discriminator_opt_state,
             generator_state, discriminator_state, key, discriminator_loss,
             generator_loss) = iteration(
                generator, discriminator, generator_opt_state, discriminator_opt_state,
                generator_state, discriminator_state, batch, key)
        recorder.record(discriminator_loss + generator_loss,
                        (generator_opt_state, discriminator_opt_state))
        if deleted is not None:
            deleted.append(all(x.is_deleted() for x in before if isinstance(x, jax.Array)))
    return recorder.run((generator, discriminator),
                        (generator_opt_state, discriminator_opt_state),
                        extra=(generator_state, discriminator_state, key))

"""Data parallelism on 4 CPU devices in the style of Equinox's parallelism example: the
batch split over a `"batch"` mesh axis, model and optimizer state replicated with
`eqx.filter_shard` (`idioms`: `"eager"` after `init`, `"in_step"`, both, or neither: then
`jax.device_put` replicates the model and the state follows it through `init`)."""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqx_offload  # (1) the import

from .common import params, Recorder, Run


STEPS = 4
DEVICES = 4
BATCH = 16
CHANNELS, HIDDEN = 4, 32


def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((DEVICES,), ("batch",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:DEVICES])


def dataloader(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(steps * BATCH, CHANNELS)).astype(np.float32)
    ys = np.sin(xs)
    return [(xs[i * BATCH:(i + 1) * BATCH], ys[i * BATCH:(i + 1) * BATCH]) for i in range(steps)]


def compute_loss(model, x, y):
    pred_y = jax.vmap(model)(x)
    return jnp.mean((y - pred_y) ** 2)


def train(port: bool, idioms: Sequence[str] = ("eager", "in_step"), donate: str = "none") -> Run:
    the_mesh = mesh()
    data_sharding = NamedSharding(the_mesh, P("batch"))
    replicated = NamedSharding(the_mesh, P())

    model = eqx.nn.MLP(CHANNELS, CHANNELS, HIDDEN, 1, key=jr.key(6789))
    if "eager" not in idioms:
        model = eqx.combine(jax.device_put(params(model), replicated), model)
    optim = optax.adamw(3e-3)
    if port:
        optim = eqx_offload.offloaded(optim)  # (2)
    jit = eqx_offload.filter_jit if port else eqx.filter_jit  # (3)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    if "eager" in idioms:
        # (4) outside `jit`, `eqx_offload.filter_shard` (the "Multi-device" docs page)
        shard = eqx_offload.filter_shard if port else eqx.filter_shard
        model, opt_state = shard((model, opt_state), replicated)

    @jit(donate=donate)
    def train_step(model, opt_state, x, y):
        if "in_step" in idioms:
            model, opt_state = eqx.filter_shard((model, opt_state), replicated)
            x, y = eqx.filter_shard((x, y), data_sharding)
        loss, grads = eqx.filter_value_and_grad(compute_loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, updates)
        if "in_step" in idioms:
            model, opt_state = eqx.filter_shard((model, opt_state), replicated)
        return model, opt_state, loss

    recorder = Recorder(port)
    for x, y in dataloader(STEPS):
        x, y = eqx.filter_shard((jnp.asarray(x), jnp.asarray(y)), data_sharding)
        with recorder.step():
            model, opt_state, loss = train_step(model, opt_state, x, y)
        recorder.record(loss, opt_state)
    return recorder.run(model, opt_state)


def train_pmap(port: bool, donate: str = "none") -> Run:
    """The same model under `eqx.filter_pmap` (a replica per device, gradients averaged
    with `pmean`, the state made per replica), the pre-sharding style."""
    model = eqx.nn.MLP(CHANNELS, CHANNELS, HIDDEN, 1, key=jr.key(6789))
    devices = jax.devices()[:DEVICES]
    optim = optax.adamw(3e-3)
    if port:
        optim = eqx_offload.offloaded(optim)  # (2); the step stays a filter_pmap
    dynamic, static = eqx.partition(model, eqx.is_array)
    replicas = jax.tree.map(lambda x: jnp.stack([x] * DEVICES), dynamic)
    models = eqx.combine(replicas, static)
    opt_states = eqx.filter_pmap(optim.init, devices=devices)(
        eqx.filter(models, eqx.is_inexact_array))

    @eqx.filter_pmap(axis_name="devices", devices=devices, donate=donate)
    def train_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(compute_loss)(model, x, y)
        grads = jax.lax.pmean(grads, "devices")
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, jax.lax.pmean(loss, "devices")

    recorder = Recorder(port)
    for x, y in dataloader(STEPS):
        x = x.reshape(DEVICES, BATCH // DEVICES, CHANNELS)
        y = y.reshape(DEVICES, BATCH // DEVICES, CHANNELS)
        with recorder.step():
            models, opt_states, loss = train_step(models, opt_states, x, y)
        recorder.record(loss, opt_states)
    return recorder.run(models, opt_states)

"""Flax NNX's MNIST tutorial, scaled down: a CNN with batch norm and dropout,
`nnx.Optimizer`, `nnx.MultiMetric` metrics updated in the step and reset every
`EVAL_EVERY` steps, an `nnx.Rngs` for dropout passed to the step, and an `eval_step`
over a test set. Ported with the lines of docs/nnx.md: the import, `offloaded(...)`, and
`eqx_offload.nnx_jit` in place of `nnx.jit` (or, `nnx_jit=False`, `nnx.jit` as written,
with docs/nnx.md's former line committing the model and the optimizer first).
"""

from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from flax import nnx

import eqx_offload  # (1) the import

from .common import Recorder, Run


STEPS, EVAL_EVERY, BATCH, SIDE, CLASSES = 7, 3, 16, 8, 4


class CNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(4, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(8, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(8 * (SIDE // 4) ** 2, 16, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(16, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array, rngs: Optional[nnx.Rngs] = None) -> jax.Array:
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def loss_fn(model: CNN, rngs: Optional[nnx.Rngs], batch: dict[str, Any]) -> Any:
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]).mean()
    return loss, logits


def dataset(seed: int, steps: int) -> list[dict[str, np.ndarray]]:
    """`steps` batches of NumPy arrays (as `tf.data`'s `as_numpy_iterator` gives them)."""
    keys = jr.split(jr.key(seed), steps)
    images = [jr.normal(k, (BATCH, SIDE, SIDE, 1)) for k in keys]
    return [{"image": np.asarray(x),
             "label": np.asarray(jnp.argmax(x.reshape(BATCH, CLASSES, -1).sum(-1), -1))}
            for x in images]


def train(port: bool, nnx_jit: bool = True) -> Run:
    """The tutorial's loop; `compiles` per training step (with the evaluation after it)."""
    model = CNN(rngs=nnx.Rngs(0))
    tx = optax.adamw(5e-3, 0.9)
    if port:
        tx = eqx_offload.offloaded(tx)  # (2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    rngs = nnx.Rngs(0)
    jit = eqx_offload.nnx_jit if port and nnx_jit else nnx.jit  # (3)
    if port and not nnx_jit:
        nnx.update((model, optimizer), eqx_offload.filter_shard(  # (3) the former line
            nnx.state((model, optimizer)), jax.sharding.make_single_device_sharding(jax.devices()[0])))

    @jit
    def train_step(model, optimizer, metrics, batch, rngs):
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(model, rngs, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)

    @jit
    def eval_step(model, metrics, batch):
        loss, logits = loss_fn(model, None, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])

    history: dict[str, list[Any]] = {"train_loss": [], "train_accuracy": [],
                                     "test_loss": [], "test_accuracy": []}
    recorder = Recorder(port)
    test_ds = dataset(2, 2)
    for step, batch in enumerate(dataset(1, STEPS)):
        with recorder.step():
            model.train()
            train_step(model, optimizer, metrics, batch, rngs)
            if step > 0 and (step % EVAL_EVERY == 0 or step == STEPS - 1):
                for metric, value in metrics.compute().items():
                    history[f"train_{metric}"].append(value)
                metrics.reset()
                model.eval()
                for test_batch in test_ds:
                    eval_step(model, metrics, test_batch)
                for metric, value in metrics.compute().items():
                    history[f"test_{metric}"].append(value)
                metrics.reset()
        recorder.record(nnx.state(model, nnx.Param)["linear2"]["bias"][...], optimizer.opt_state)
    return recorder.run(nnx.state(model), optimizer.opt_state,
                        extra=(history, jax.tree.leaves(nnx.state(rngs))))

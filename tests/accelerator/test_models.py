"""Every documented mode of the model techniques trains on the accelerator: weights
(fp32, and bf16 with fp32 master weights) and layer inputs in host memory through
`scan_layers`, gradient accumulation, a narrowed state. Each run's loss falls, what the
docs say lives in host memory is there between steps, and each agrees with the same
training with everything on the device."""

from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload


D, LAYERS, TOKENS, STEPS = 1024, 4, 512, 5


class Block(eqx.Module):
    """A pre-norm residual MLP block; `scale` is a per-layer vector, stacked as
    `(LAYERS, D)` (as a decoder's norm scales are)."""

    scale: jax.Array
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.scale = jnp.ones(D)
        self.up = eqx.nn.Linear(D, 4 * D, key=k1)
        self.down = eqx.nn.Linear(4 * D, D, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        wide = x.astype(jnp.float32)
        normed = (wide * jax.lax.rsqrt(jnp.mean(wide ** 2) + 1e-6)).astype(x.dtype)
        return x + self.down(jax.nn.silu(self.up(normed * self.scale)))


def _blocks(dtype: Any = jnp.float32) -> Any:
    blocks = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), LAYERS))
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, blocks)


def _batch(dtype: Any = jnp.float32) -> tuple[jax.Array, jax.Array]:
    x, y = jax.random.normal(jax.random.key(1), (2, TOKENS, D))
    return x.astype(dtype), y


def _loss(model: Any, batch: Any, offload_input: bool = False) -> jax.Array:
    x, y = batch
    out = jax.vmap(lambda t: eqx_offload.scan_layers(model, t, offload_input=offload_input))(x)
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _run(update: Callable[..., Any], model: Any, state: Any, batch: Any,
         offload_input: bool = False) -> tuple[list[float], Any]:
    """`STEPS` donated steps of `update(grads, state, model) -> (model, state)`."""
    @eqx_offload.filter_jit(donate=("model", "state"))
    def step(model: Any, state: Any, batch: Any) -> Any:
        loss, grads = eqx.filter_value_and_grad(_loss)(model, batch, offload_input)
        model, state = update(grads, state, model)
        return model, state, loss

    losses = []
    for _ in range(STEPS):
        model, state, loss = step(model, state, batch)
        losses.append(float(loss))
    return losses, (model, state)


def _kinds(tree: Any) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if eqx.is_array(x) and x.ndim}


def _falls(losses: list[float]) -> None:
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def _on_device_adamw(model: Any, batch: Any) -> list[float]:
    """The reference: plain AdamW, everything on the device."""
    opt = optax.adamw(1e-3)

    def update(grads: Any, state: Any, model: Any) -> Any:
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    losses, _ = _run(update, model, opt.init(eqx.filter(model, eqx.is_array)), batch)
    return losses


def test_fp32_weights_in_host_memory_train_as_on_the_device(accelerator: str) -> None:
    """`host_weights_optimizer` with the blocks' weights in host memory, the AdamW state
    offloaded: the weights and the state are in host memory between steps, and the
    losses follow plain AdamW with the weights on the device to 1e-4 relative."""
    hp = eqx_offload.host_weights_optimizer(optax.adamw(1e-3))
    model = eqx_offload.to_host(_blocks())
    losses, (model, state) = _run(hp.update, model, hp.init(model), _batch())
    _falls(losses)
    assert _kinds(model) == {"pinned_host"}
    assert "pinned_host" in _kinds(state)
    plain = _on_device_adamw(_blocks(), _batch())
    assert np.allclose(losses, plain, rtol=1e-4, atol=0), (losses, plain)


@pytest.mark.parametrize("offload_input", [False, True], ids=["weights", "weights+inputs"])
def test_bf16_weights_in_host_memory_with_master_weights(accelerator: str,
                                                         offload_input: bool) -> None:
    """bf16 compute weights in host memory (per-layer vectors included), fp32 master
    weights and AdamW state offloaded, and optionally each layer's input in host memory:
    it trains, everything but the step counter lives in host memory, and the losses
    follow the same `master_weights` with everything on the device to 1e-2 relative (bf16
    compute: two programs' fusions round differently)."""
    mw = eqx_offload.master_weights(optax.adamw(1e-3))
    model, state = mw.init(eqx_offload.to_host(_blocks()))
    assert {x.dtype for x in jax.tree.leaves(model)} == {jnp.dtype(jnp.bfloat16)}
    batch = _batch(jnp.bfloat16)
    losses, (model, state) = _run(mw.update, model, state, batch, offload_input)
    _falls(losses)
    assert _kinds(model) == {"pinned_host"}
    assert _kinds(state.inner_state.master) == {"pinned_host"}
    on_device = eqx_offload.master_weights(optax.adamw(1e-3), offload=None)
    reference, _ = _run(on_device.update, *on_device.init(_blocks()), batch, offload_input)
    assert np.allclose(losses, reference, rtol=1e-2, atol=0), (losses, reference)


def test_accumulated_updates_follow_multi_steps(accelerator: str) -> None:
    """`offloaded(optax.MultiSteps(adamw, 2))`: the state crosses once per optimizer
    step, stays in host memory, and the losses follow plain `MultiSteps` to 1e-4."""
    def trained(opt: Any) -> tuple[list[float], Any]:
        def update(grads: Any, state: Any, model: Any) -> Any:
            updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state
        model = _blocks()
        return _run(update, model, opt.init(eqx.filter(model, eqx.is_array)), _batch())

    plain, _ = trained(optax.MultiSteps(optax.adamw(1e-3), 2))
    losses, (_, state) = trained(eqx_offload.offloaded(optax.MultiSteps(optax.adamw(1e-3), 2)))
    _falls(losses)
    assert "pinned_host" in _kinds(state)
    assert np.allclose(losses, plain, rtol=1e-4, atol=0), (losses, plain)


def test_state_narrowed_in_host_memory_trains(accelerator: str) -> None:
    """`host_dtype=bfloat16`: the moments wait in host memory as bf16 and the run trains
    (not equal to plain: the moments are rounded between steps, as documented)."""
    opt = eqx_offload.offloaded(optax.adamw(1e-3), host_dtype=jnp.bfloat16)

    def update(grads: Any, state: Any, model: Any) -> Any:
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    model = _blocks()
    losses, (_, state) = _run(update, model, opt.init(eqx.filter(model, eqx.is_array)),
                              _batch())
    _falls(losses)
    adam = state.inner_state[0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert _kinds((adam.mu, adam.nu)) == {"pinned_host"}

"""fp32 master weights in host memory, bf16 compute weights on the device."""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import count_compiles, hex_bits as bits, memory_kinds, unchecked

import eqx_offload
from eqx_offload.cli import models


def make_model() -> eqx.nn.MLP:
    return eqx.nn.MLP(8, 8, 32, 2, key=jax.random.key(0))


def loss_fn(model: Any, x: jax.Array) -> jax.Array:
    return jnp.mean(jax.vmap(model)(x).astype(jnp.float32) ** 2)


def make_step(mw: Any) -> Any:
    def step(model: Any, state: Any, x: jax.Array) -> Any:
        grads = eqx.filter_grad(loss_fn)(model, x)
        return mw.update(grads, state, model)
    return step


def reference_step(inner: Any) -> Any:
    """The update written out: fp32 master and state on device, bf16 weights rounded."""
    def step(model: Any, master: Any, state: Any, x: jax.Array) -> Any:
        grads = eqx.filter_grad(loss_fn)(model, x)
        wide = jtu.tree_map(lambda g: g.astype(jnp.float32), eqx.filter(grads, eqx.is_array))
        updates, state = inner.update(wide, state, master)
        master = optax.apply_updates(master, updates)
        params = jtu.tree_map(lambda m: m.astype(jnp.bfloat16), master)
        return eqx.combine(params, eqx.filter(model, eqx.is_array, inverse=True)), master, state

    return eqx.filter_jit(step)


def master_of(state: Any) -> Any:
    return (state.inner_state if isinstance(state, eqx_offload.OffloadedState) else state).master


OFFLOADS = {
    "offloaded": eqx_offload.offloaded,
    "streamed": functools.partial(eqx_offload.offloaded, group_bytes=0),
    "device": None,
}


@pytest.mark.parametrize("offload", list(OFFLOADS))
def test_master_weights_bitwise_and_memory_kinds(offload: str) -> None:
    """Donated steps, one compile, bitwise the written-out update; kinds kept."""
    inner = optax.adamw(1e-2)
    mw = eqx_offload.master_weights(inner, offload=OFFLOADS[offload])
    model, state = mw.init(make_model())
    step = eqx_offload.filter_jit(make_step(mw), donate="all")
    ref = reference_step(inner)
    master = eqx.filter(make_model(), eqx.is_array)
    ref_model, ref_state = mw.init(make_model())[0], inner.init(master)
    x = jax.random.normal(jax.random.key(1), (16, 8), jnp.bfloat16)
    host = "device" if offload == "device" else "pinned_host"
    for i in range(3):
        old = model
        with count_compiles("step") as compiles:
            model, state = step(model, state, x)
        assert len(compiles) == (i == 0)
        assert old.layers[0].weight.is_deleted()
        ref_model, master, ref_state = ref(ref_model, master, ref_state, x)
        rounded = jtu.tree_map(lambda m: np.asarray(m).astype(jnp.bfloat16), master_of(state))
        assert bits(model) == bits(rounded) == bits(ref_model)  # (`bits` reads array leaves)
        assert bits(master_of(state)) == bits(master)
        inner_state = (state.inner_state if offload != "device" else state).inner_state
        assert bits(inner_state) == bits(ref_state)
    assert set(memory_kinds(model).values()) == {"device"}
    assert {x.dtype for x in jtu.tree_leaves(eqx.filter(model, eqx.is_array))} == {
        jnp.dtype(jnp.bfloat16)}
    assert set(memory_kinds(master_of(state)).values()) == {host}
    assert {x.dtype for x in jtu.tree_leaves(master_of(state))} == {jnp.dtype(jnp.float32)}
    moments = [v for k, v in memory_kinds(state).items() if "/mu/" in k or "/nu/" in k]
    assert moments and set(moments) == {host}


def test_master_weights_non_float_leaves_pass_through_and_bad_options() -> None:
    mw = eqx_offload.master_weights(optax.sgd(0.1))
    params = {"w": jnp.ones(4), "steps": jnp.arange(3)}
    model, state = mw.init(params)
    assert model["w"].dtype == jnp.bfloat16 and model["steps"].dtype == jnp.arange(3).dtype
    assert master_of(state)["steps"] is None
    grads = {"w": jnp.ones(4, jnp.bfloat16), "steps": jnp.zeros(3, jnp.arange(3).dtype)}
    new, _ = jax.jit(mw.update)(grads, state, model)
    assert bits(new["steps"]) == bits(params["steps"])
    assert np.asarray(new["w"]).astype(np.float32).tolist() == [0.8984375] * 4  # bf16(0.9)
    with pytest.raises(eqx_offload.errors.OptionError, match="compute_dtype"):
        eqx_offload.master_weights(optax.sgd(0.1), compute_dtype=jnp.int32)
    with pytest.raises(eqx_offload.errors.OptionError, match="offload"):
        unchecked(eqx_offload.master_weights)(optax.sgd(0.1), offload="host")


def train(model: Any, loss: Any, batches: Any, opt: Any, mixed: bool) -> list[float]:
    """Losses of a training run: plain fp32, or bf16 compute with master weights."""
    if mixed:
        mw = eqx_offload.master_weights(opt)
        model, state = mw.init(model)

        @eqx_offload.filter_jit(donate="all")
        def step(model: Any, state: Any, batch: Any) -> Any:
            value, grads = eqx.filter_value_and_grad(loss)(model, batch)
            return *mw.update(grads, state, model), value
    else:
        state = opt.init(eqx.filter(model, eqx.is_array))
        step = eqx.filter_jit(models.make_step(opt, loss))
    losses = []
    for batch in batches:
        model, state, value = step(model, state, batch)
        losses.append(float(value))
    return losses


def _demo_task() -> tuple[Any, Any, Any]:
    width = 32
    model = models.make_mlp(width, 2, width, seed=0)

    def loss(model: Any, batch: Any) -> jax.Array:
        x, y = batch
        out = jax.vmap(model)(x.astype(jax.tree.leaves(model)[0].dtype))
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    return model, loss, models.regression_batches(width, 32, 60, seed=0)


def _transformer() -> tuple[Any, Any, Any]:
    shape = models.LMShape(vocab=64, width=32, layers=2, heads=2, seq=16, batch=4)
    loss = lambda m, tokens: models.lm_loss(m, tokens).astype(jnp.float32)  # noqa: E731
    return models.make_lm(shape, seed=0), loss, models.token_batches(shape, 40, seed=0)


@pytest.mark.parametrize("task, lr, learns, within", [
    (_demo_task, 3e-3, 0.6, 0.02), (_transformer, 1e-2, 0.8, 0.03)], ids=["mlp", "transformer"])
def test_master_weights_loss_curve_follows_fp32(task: Any, lr: float, learns: float,
                                                within: float) -> None:
    """bf16 with fp32 master weights learns and ends near plain fp32 AdamW."""
    model, loss, batches = task()
    plain = train(model, loss, batches, optax.adamw(lr), mixed=False)
    mixed = train(model, loss, batches, optax.adamw(lr), mixed=True)
    assert mixed[-1] < learns * mixed[0]
    assert abs(np.mean(mixed[-5:]) - np.mean(plain[-5:])) < within * np.mean(plain[-5:])


def test_master_weights_with_compute_weights_in_host_memory() -> None:
    """Host compute weights stay on host, bitwise the device ones."""
    x = jax.random.normal(jax.random.key(2), (16, 8), jnp.bfloat16)
    results = []
    for wrap in (eqx_offload.host_weights, eqx_offload.types.HostWeights):
        mw = eqx_offload.master_weights(optax.adamw(1e-2))
        model, state = mw.init(eqx.tree_at(lambda m: m.layers[1], make_model(), replace_fn=wrap))
        step = eqx.filter_jit(make_step(mw))
        for _ in range(2):
            model, state = step(model, state, x)
        results.append((model, state))
    (host_model, host_state), (device_model, device_state) = results
    kinds = memory_kinds(host_model)
    assert kinds.pop("layers/1/module/weight") == kinds.pop("layers/1/module/bias") == "pinned_host"
    assert set(kinds.values()) == {"device"}
    assert set(memory_kinds(device_model).values()) == {"device"}
    assert bits((host_model, host_state)) == bits((device_model, device_state))  # array leaves

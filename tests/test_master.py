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
from helpers import count_compiles, memory_kinds, unchecked

import eqx_offload
from eqx_offload.cli import models


def bits(tree: Any) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jtu.tree_leaves(tree)]


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
    """The same update written out: fp32 master weights and state on the device, bf16
    gradients widened, the update in fp32, the compute weights rounded from it."""

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
        # the new bf16 weights are exactly the rounding of the new fp32 master weights
        rounded = jtu.tree_map(lambda m: np.asarray(m).astype(jnp.bfloat16), master_of(state))
        assert bits(eqx.filter(model, eqx.is_array)) == bits(rounded)
        # ... and the whole update is bitwise the one written out
        assert bits(eqx.filter(model, eqx.is_array)) == bits(eqx.filter(ref_model, eqx.is_array))
        assert bits(master_of(state)) == bits(master)
        inner_state = (state.inner_state if offload != "device" else state).inner_state
        assert bits(inner_state) == bits(ref_state)
    assert set(memory_kinds(model).values()) == {"device"}
    assert {jnp.dtype(x.dtype) for x in jtu.tree_leaves(eqx.filter(model, eqx.is_array))} == {
        jnp.dtype(jnp.bfloat16)}
    assert set(memory_kinds(master_of(state)).values()) == {host}
    assert {jnp.dtype(x.dtype) for x in jtu.tree_leaves(master_of(state))} == {jnp.dtype(jnp.float32)}
    moments = memory_kinds(state)
    assert {k: v for k, v in moments.items() if "/mu/" in k or "/nu/" in k} and all(
        v == host for k, v in moments.items() if "/mu/" in k or "/nu/" in k)


def test_master_weights_non_float_leaves_pass_through() -> None:
    mw = eqx_offload.master_weights(optax.sgd(0.1))
    params = {"w": jnp.ones(4), "steps": jnp.arange(3)}
    model, state = mw.init(params)
    assert model["w"].dtype == jnp.bfloat16 and model["steps"].dtype == jnp.arange(3).dtype
    assert master_of(state)["steps"] is None
    grads = {"w": jnp.ones(4, jnp.bfloat16), "steps": jnp.zeros(3, jnp.arange(3).dtype)}
    new, _ = jax.jit(mw.update)(grads, state, model)
    assert bits(new["steps"]) == bits(params["steps"])
    assert np.asarray(new["w"]).astype(np.float32).tolist() == [0.8984375] * 4  # bf16(0.9)


def test_master_weights_bad_options() -> None:
    with pytest.raises(eqx_offload.OptionError, match="compute_dtype"):
        eqx_offload.master_weights(optax.sgd(0.1), compute_dtype=jnp.int32)
    with pytest.raises(eqx_offload.OptionError, match="offload"):
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


def test_master_weights_loss_curve_follows_fp32_on_the_demo_task() -> None:
    """The demo's regression MLP, 60 steps of AdamW: bf16 compute with fp32 master
    weights ends within 5% of plain fp32 training (and learns: under half the start)."""
    width = 32
    batches = models.regression_batches(width, 32, 60, seed=0)
    model = models.make_mlp(width, 2, width, seed=0)

    def loss(model: Any, batch: Any) -> jax.Array:
        x, y = batch
        out = jax.vmap(model)(x.astype(jax.tree.leaves(model)[0].dtype))
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

    plain = train(model, loss, batches, optax.adamw(3e-3), mixed=False)
    mixed = train(model, loss, batches, optax.adamw(3e-3), mixed=True)
    assert mixed[-1] < 0.6 * mixed[0]
    assert abs(np.mean(mixed[-5:]) - np.mean(plain[-5:])) < 0.02 * np.mean(plain[-5:])


def test_master_weights_loss_curve_follows_fp32_on_the_transformer() -> None:
    """The benchmark's transformer LM (small), 40 steps of AdamW: bf16 compute with
    fp32 master weights ends within 3% of plain fp32 training, and learns."""
    shape = models.LMShape(vocab=64, width=32, layers=2, heads=2, seq=16, batch=4)
    batches = models.token_batches(shape, 40, seed=0)
    model = models.make_lm(shape, seed=0)

    def loss(model: Any, tokens: Any) -> jax.Array:
        return models.lm_loss(model, tokens).astype(jnp.float32)

    plain = train(model, loss, batches, optax.adamw(1e-2), mixed=False)
    mixed = train(model, loss, batches, optax.adamw(1e-2), mixed=True)
    assert mixed[-1] < 0.8 * mixed[0]
    assert abs(np.mean(mixed[-5:]) - np.mean(plain[-5:])) < 0.03 * np.mean(plain[-5:])


def test_master_weights_with_compute_weights_in_host_memory() -> None:
    """bf16 compute weights kept in host memory (`host_weights`) stay there after the
    update, their gradients come from host memory, and every bit is that of the same
    model with its compute weights on the device."""
    x = jax.random.normal(jax.random.key(2), (16, 8), jnp.bfloat16)
    results = []
    for wrap in (eqx_offload.host_weights, eqx_offload.HostWeights):
        mw = eqx_offload.master_weights(optax.adamw(1e-2))
        model, state = mw.init(eqx.tree_at(lambda m: m.layers[1], make_model(), replace_fn=wrap))
        step = eqx.filter_jit(make_step(mw))  # (eqx_offload.filter_jit: see test_params REMAT2)
        for _ in range(2):
            model, state = step(model, state, x)
        results.append((model, state))
    (host_model, host_state), (device_model, device_state) = results
    kinds = memory_kinds(host_model)
    assert kinds.pop("layers/1/module/weight") == kinds.pop("layers/1/module/bias") == "pinned_host"
    assert set(kinds.values()) == {"device"}
    assert set(memory_kinds(device_model).values()) == {"device"}
    assert bits(eqx.filter(host_model, eqx.is_array)) == bits(eqx.filter(device_model, eqx.is_array))
    assert bits(host_state) == bits(device_state)

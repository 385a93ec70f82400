"""`master_weights` with narrowed moments: `offloaded`'s `host_dtype` narrows the
optimizer's moments, never the fp32 master weights; a narrower master is
`master_dtype`'s choice, and warns where it is no wider than the weights."""

import functools
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import assert_tree_equal

import eqx_offload
from eqx_offload._optim import quantize as q
from eqx_offload.errors import OffloadWarning


ADAMW = optax.adamw(1e-2, weight_decay=0.1)


def _mlp() -> eqx.nn.MLP:
    # Weights of 8192 values and more, which 8-bit state keeps quantised; the biases
    # (64 or 128 values) keep their dtype.
    return eqx.nn.MLP(64, 64, 128, 2, key=jax.random.key(0))


def _loss(model: Any, x: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x).astype(jnp.float32) - 1) ** 2)


def _batch(i: int) -> jax.Array:
    return jax.random.normal(jax.random.key(10 + i), (16, 64), jnp.bfloat16)


def _moments(host_dtype: Any) -> tuple[Any, Any]:
    """`(narrow, widen)` of one moment leaf as `offloaded(host_dtype=...)` keeps it,
    written out: a cast to bf16 and back; 8-bit, the leaves of at least 4096 values
    quantised (mu with the signed map, nu with the unsigned) and dequantised."""
    if host_dtype == jnp.bfloat16:
        return (lambda x, signed: x.astype(jnp.bfloat16),
                lambda x, signed, shape: x.astype(jnp.float32))

    def narrow(x: jax.Array, signed: bool) -> jax.Array:
        return q.quantize(x, signed) if x.size >= 4096 else x

    def widen(x: jax.Array, signed: bool, shape: tuple[int, ...]) -> jax.Array:
        if x.dtype != jnp.uint32:
            return x
        return q.dequantize(x, q.Quantized(np.dtype(np.float32), shape, signed))

    return narrow, widen


def _emulation(host_dtype: Any) -> tuple[Any, Any]:
    """`(init, step)` of the unwrapped computation: fp32 master weights and AdamW on
    the device, the moments narrowed after each update and widened before the next,
    the bf16 weights the new master rounded."""
    narrow, widen = _moments(host_dtype)

    def narrowed(state: Any) -> Any:
        adam = state[0]
        return (adam._replace(mu=jtu.tree_map(lambda x: narrow(x, True), adam.mu),
                              nu=jtu.tree_map(lambda x: narrow(x, False), adam.nu)),
                *state[1:])

    def widened(state: Any, master: Any) -> Any:
        adam = state[0]
        return (adam._replace(
            mu=jtu.tree_map(lambda x, m: widen(x, True, m.shape), adam.mu, master),
            nu=jtu.tree_map(lambda x, m: widen(x, False, m.shape), adam.nu, master)),
            *state[1:])

    def init(model: Any) -> tuple[Any, Any, Any]:
        master = eqx.filter(model, eqx.is_array)
        compute = jtu.tree_map(lambda m: m.astype(jnp.bfloat16), master)
        return (eqx.combine(compute, eqx.filter(model, eqx.is_array, inverse=True)), master,
                narrowed(ADAMW.init(master)))

    @eqx.filter_jit
    def step(model: Any, master: Any, state: Any, x: jax.Array) -> Any:
        value, grads = eqx.filter_value_and_grad(_loss)(model, x)
        wide = jtu.tree_map(lambda g: g.astype(jnp.float32), eqx.filter(grads, eqx.is_array))
        updates, state = ADAMW.update(wide, widened(state, master), master)
        master = optax.apply_updates(master, updates)
        params = jtu.tree_map(lambda m: m.astype(jnp.bfloat16), master)
        model = eqx.combine(params, eqx.filter(model, eqx.is_array, inverse=True))
        return value, model, master, narrowed(state)

    return init, step


def _expected(path: str, leaf: jax.Array, host_dtype: Any) -> tuple[Any, str]:
    """Where each leaf of the state lives, and in what dtype: the master fp32 in host
    memory; the moments narrowed there; the step count on the device."""
    if path.startswith(".master"):
        return jnp.dtype(jnp.float32), "pinned_host"
    if path.endswith(".count"):
        return jnp.dtype(jnp.int32), "device"
    assert ".mu" in path or ".nu" in path, path
    if host_dtype == jnp.bfloat16:
        return jnp.dtype(jnp.bfloat16), "pinned_host"
    big = "weight" in path  # (the weights' moments are quantised, the biases' are not)
    return jnp.dtype(jnp.uint32 if big else jnp.float32), "pinned_host"


@pytest.mark.parametrize("host_dtype", [jnp.bfloat16, jnp.int8], ids=["bf16", "int8"])
def test_fp32_master_beside_narrowed_moments(host_dtype: Any) -> None:
    """Every leaf of the state where it should be, in its dtype; three donated steps
    bitwise the emulation (the model, the master weights and the moments)."""
    mw = eqx_offload.master_weights(
        ADAMW, offload=functools.partial(eqx_offload.offloaded, host_dtype=host_dtype))
    model, state = mw.init(_mlp())
    ref_model, master, ref_state = _emulation(host_dtype)[0](_mlp())
    ref_step = _emulation(host_dtype)[1]

    @eqx_offload.filter_jit(donate="all")
    def step(model: Any, state: Any, x: jax.Array) -> Any:
        value, grads = eqx.filter_value_and_grad(_loss)(model, x)
        return (value, *mw.update(grads, state, model))

    for i in range(3):
        value, model, state = step(model, state, _batch(i))
        ref_value, ref_model, master, ref_state = ref_step(ref_model, master, ref_state,
                                                           _batch(i))
        assert_tree_equal((value, model), (ref_value, ref_model))
        assert_tree_equal(jax.device_get(state.inner_state.master), jax.device_get(master))
        assert_tree_equal(jax.device_get(state.inner_state.inner_state),
                          jax.device_get(ref_state))
    leaves = jtu.tree_flatten_with_path(state.inner_state)[0]
    assert len(leaves) == 3 * len(jtu.tree_leaves(master)) + 1  # master, mu, nu; a count
    for path, leaf in leaves:
        where = jtu.keystr(path)
        assert (leaf.dtype, leaf.sharding.memory_kind) == _expected(where, leaf, host_dtype), where
    assert {(x.dtype, x.sharding.memory_kind) for x in jtu.tree_leaves(eqx.filter(model, eqx.is_array))} == {
        (jnp.dtype(jnp.bfloat16), "device")}


def test_a_master_no_wider_than_the_weights_warns_and_is_kept() -> None:
    """`master_dtype=jnp.bfloat16` is the one way to a bf16 master: it warns, and the
    master stays bf16 in host memory; fp32 (the default) does not warn."""
    with pytest.warns(OffloadWarning, match="master_dtype=jnp.float32"):
        mw = eqx_offload.master_weights(
            ADAMW, master_dtype=jnp.bfloat16,
            offload=functools.partial(eqx_offload.offloaded, host_dtype=jnp.bfloat16))
    _, state = mw.init(_mlp())
    assert {(x.dtype, x.sharding.memory_kind)
            for x in jtu.tree_leaves(state.inner_state.master)} == {
        (jnp.dtype(jnp.bfloat16), "pinned_host")}
    with pytest.warns(OffloadWarning, match="compute_dtype=float16"):
        eqx_offload.master_weights(ADAMW, master_dtype=jnp.float16, compute_dtype=jnp.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqx_offload.master_weights(ADAMW)
        eqx_offload.master_weights(ADAMW, master_dtype=jnp.float32, compute_dtype=jnp.float16)

"""8-bit optimizer state (`host_dtype=jnp.int8`) in the rest of the library: donated
steps, `master_weights`, checkpoints, the option itself."""

import functools
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import pytest
from helpers import assert_tree_equal, count_compiles, donated_step

import eqx_offload


INT8 = functools.partial(eqx_offload.offloaded, host_dtype=jnp.int8)


def _mlp() -> eqx.nn.MLP:
    return eqx.nn.MLP(64, 64, 128, 2, key=jax.random.key(0))  # 64 x 128 weights: 8192 values


def _packed(tree: object) -> list[jax.Array]:
    return [x for x in jtu.tree_leaves(tree) if x.dtype == jnp.uint32]


def test_donated_steps_delete_the_packed_state_and_compile_once() -> None:
    step, (model, state, x) = donated_step(INT8(optax.adamw(1e-3)), _mlp(),
                                           jnp.ones((8, 64)))
    with count_compiles("step") as compiles:
        for _ in range(3):
            old = _packed(state)
            model, state = step(model, state, x)
            assert len(old) == 6 and all(a.is_deleted() for a in old)  # mu, nu of 3 weights
    assert len(compiles) == 1
    assert {a.sharding.memory_kind for a in _packed(state)} == {"pinned_host"}


def test_master_weights_stay_float32_beside_int8_moments() -> None:
    """`master_weights(..., offload=INT8)`: the fp32 master weights are not quantised,
    only Adam's moments; the step trains (its loss falls)."""
    mw = eqx_offload.master_weights(optax.adam(1e-2), offload=INT8)
    model, state = mw.init(_mlp())
    master = state.inner_state.master
    big = [w for w in jtu.tree_leaves(master) if w.size >= 4096]
    assert big and {(w.dtype, w.sharding.memory_kind) for w in jtu.tree_leaves(master)} == {
        (jnp.dtype(jnp.float32), "pinned_host")}
    adam = state.inner_state.inner_state[0]
    assert len(_packed(adam.mu)) == len(_packed(adam.nu)) == len(big)
    x = jax.random.normal(jax.random.key(1), (16, 64), jnp.bfloat16)

    def loss(m: eqx.nn.MLP) -> jax.Array:
        return jnp.mean((jax.vmap(m)(x).astype(jnp.float32) - 1) ** 2)

    @eqx_offload.filter_jit(donate="all")
    def step(model: eqx.nn.MLP, state: object) -> tuple:
        value, grads = eqx.filter_value_and_grad(loss)(model)
        return (*mw.update(grads, state, model), value)

    losses = []
    for _ in range(5):
        model, state, value = step(model, state)
        losses.append(float(value))
    assert losses[-1] < losses[0] / 2
    assert {w.dtype for w in jtu.tree_leaves(state.inner_state.master)} == {jnp.dtype(jnp.float32)}


def test_checkpoint_resume_is_bitwise(tmp_path: Path) -> None:
    """Saved with Equinox's serialisation after 2 steps and restored into host memory
    (`checkpoint.abstract_init`: the packed shapes), 2 more steps are bitwise 4 steps."""
    opt = INT8(optax.adamw(1e-3))
    step, (model, state, x) = donated_step(opt, _mlp(), jnp.ones((8, 64)))
    for _ in range(2):
        model, state = step(model, state, x)
    eqx.tree_serialise_leaves(tmp_path / "state.eqx", state)
    target = eqx_offload.checkpoint.abstract_init(opt, eqx.filter(model, eqx.is_array))
    assert [t.shape for t in _packed(target)] == [a.shape for a in _packed(state)]
    restored = eqx_offload.checkpoint.tree_deserialise_leaves(tmp_path / "state.eqx", target)
    assert {a.sharding.memory_kind for a in _packed(restored)} == {"pinned_host"}
    assert_tree_equal(jax.device_get(restored), jax.device_get(state))
    model_copy = jtu.tree_map(lambda a: a.copy() if eqx.is_array(a) else a, model)
    straight_model, straight = model, state
    for _ in range(2):
        straight_model, straight = step(straight_model, straight, x)
    for _ in range(2):
        model_copy, restored = step(model_copy, restored, x)
    assert_tree_equal(jax.device_get((model_copy, restored)),
                      jax.device_get((straight_model, straight)))


@pytest.mark.parametrize("given", [jnp.int8, jnp.uint8, "int8", "uint8"])
def test_every_8bit_integer_dtype_means_the_quantised_form(given: object) -> None:
    state = eqx_offload.offloaded(optax.adam(1e-3), host_dtype=given).init(
        {"w": jnp.ones((64, 128))})
    assert state.inner_state[0].mu["w"].shape == (66, 32)  # 64 rows of codes, 2 of scales


def test_int8_with_host_compute_is_refused() -> None:
    with pytest.raises(eqx_offload.errors.OptionError, match="nothing to narrow"):
        eqx_offload.offloaded(optax.adam(1e-3), host_dtype=jnp.int8, compute="host")

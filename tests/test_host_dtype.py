"""`offloaded(..., host_dtype=jnp.bfloat16)`: the state crosses and rests in a narrower
dtype. Not bitwise equal to the unwrapped optimizer, but bitwise equal to its emulation
compiled the same way: the unwrapped optimizer whose selected state leaves are kept in
`host_dtype` after every `init` and `update`, and widened back inside the update.

Why "compiled the same way": XLA's CPU compiler always allows fused multiply-adds, and
which product of `b1 * mu + (1 - b1) * g` it contracts depends on the program (with
`mu` converted from bfloat16 in the same fusion it picks the other one). An emulation
that rounds the state in a separate program, outside a `jit` that takes float32, then
differs from the narrowing program in the last bits of Adam's updates on some CPUs
(AVX-512 with JAX 0.12), which is no error of either. Widening inside the compiled
update, as `offloaded` does, gives both programs the same arithmetic; eagerly both run
op by op, where nothing is contracted."""

import re
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import assert_tree_equal, tree_equal

import eqx_offload


# JAX-version dependent: also run in the newest environment (scripts/check.sh).
pytestmark = pytest.mark.both


def _params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {
        "w": jax.device_put(rng.standard_normal((16, 8)).astype(np.float32), jax.devices()[0]),
        "b": jax.device_put(rng.standard_normal(8).astype(np.float32), jax.devices()[0]),
        "h": jax.device_put(rng.standard_normal(8).astype(np.float16), jax.devices()[0]),
        "s": jax.device_put(np.float32(0.5), jax.devices()[0]),
    }


def _grads(params: Any, step: int) -> Any:
    return jtu.tree_map(lambda x: (x * (step + 1) + 0.25).astype(x.dtype), params)


def _narrowed(state: Any, dtype: Any) -> Any:
    """What `host_dtype` keeps of a state: floating leaves with >= 1 dimension (the
    default `where`) that are wider than `dtype`, in `dtype`."""
    def cut(x: Any) -> Any:
        if (isinstance(x, jax.Array) and x.ndim and jnp.issubdtype(x.dtype, jnp.floating)
                and x.dtype.itemsize > jnp.dtype(dtype).itemsize):
            return x.astype(dtype)
        return x
    return jtu.tree_map(cut, state)


def _widened(state: Any, like: Any) -> Any:
    return jtu.tree_map(lambda x, y: x.astype(y.dtype), state, like)


def _emulation(inner: optax.GradientTransformation, params: Any, dtype: Any) -> Any:
    """`inner.update` on a state kept in `dtype`: widened to the dtypes `inner.init`
    gives, updated, narrowed again (one program under `jit`, as in `offloaded`)."""
    like = inner.init(params)

    def update(updates: Any, state: Any, params: Any) -> Any:
        updates, state = inner.update(updates, _widened(state, like), params)
        return updates, _narrowed(state, dtype)
    return update


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("name", ["adam", "adafactor", "sgd_momentum"])
def test_equals_the_rounded_optimizer(name: str, mode: str) -> None:
    make = {"adam": lambda: optax.adam(0.1), "adafactor": lambda: optax.adafactor(0.1),
            "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9)}[name]
    inner, opt = make(), eqx_offload.offloaded(make(), host_dtype=jnp.bfloat16)
    params = _params()
    update, ref_update = opt.update, _emulation(inner, params, jnp.bfloat16)
    if mode == "jit":
        update, ref_update = eqx_offload.filter_jit(update), jax.jit(ref_update)
    wide = inner.init(params)
    state, ref_state = opt.init(params), _narrowed(wide, jnp.bfloat16)
    for step in range(3):
        updates, state = update(_grads(params, step), state, params)
        ref_updates, ref_state = ref_update(_grads(params, step), ref_state, params)
        assert_tree_equal(updates, ref_updates)
        assert_tree_equal(state.inner_state, ref_state)  # dtypes included
        for leaf, ref in zip(jtu.tree_leaves(state.inner_state), jtu.tree_leaves(wide), strict=True):
            narrowed = leaf.ndim and ref.dtype in (jnp.float32,)
            assert leaf.dtype == (jnp.bfloat16 if narrowed else ref.dtype), (leaf.dtype, ref.dtype)
            assert leaf.sharding.memory_kind == ("pinned_host" if leaf.ndim else "device")
        params = optax.apply_updates(params, updates)


def test_the_emulation_rounds_like_a_cast_and_back() -> None:
    """The emulation above is the rounding it stands for: kept in bfloat16, widened,
    updated and narrowed, its state equals (op by op, eagerly: no fused multiply-adds)
    the float32 optimizer's state rounded to bfloat16 and back after every update, and
    is not the float32 state itself."""
    inner, params = optax.adam(0.1), _params()
    update = _emulation(inner, params, jnp.bfloat16)
    wide = inner.init(params)
    state, rounded = _narrowed(wide, jnp.bfloat16), wide
    for step in range(3):
        updates, state = update(_grads(params, step), state, params)
        ref_updates, rounded = inner.update(_grads(params, step), rounded, params)
        rounded = _widened(_narrowed(rounded, jnp.bfloat16), wide)
        assert_tree_equal(updates, ref_updates)
        assert_tree_equal(_widened(state, wide), rounded)
    full = inner.init(params)
    for step in range(3):
        _, full = inner.update(_grads(params, step), full, params)
    assert not tree_equal(_widened(state, wide), full)


def test_host_bytes_halved() -> None:
    params = {"w": jnp.ones((64, 64))}
    full = eqx_offload.offloaded(optax.adam(0.1)).init(params)
    half = eqx_offload.offloaded(optax.adam(0.1), host_dtype=jnp.bfloat16).init(params)
    full_bytes = eqx_offload.memory_report(full).host_bytes
    assert eqx_offload.memory_report(half).host_bytes * 2 == full_bytes == 2 * 64 * 64 * 4


def test_streamed_equals_default() -> None:
    params = _params()
    default = eqx_offload.offloaded(optax.adam(0.1), host_dtype=jnp.bfloat16)
    streamed = eqx_offload.offloaded(optax.adam(0.1), host_dtype=jnp.bfloat16, group_bytes=0)
    s1, s2 = default.init(params), streamed.init(params)
    u1f, u2f = jax.jit(default.update), jax.jit(streamed.update)
    for step in range(3):
        u1, s1 = u1f(_grads(params, step), s1, params)
        u2, s2 = u2f(_grads(params, step), s2, params)
        assert_tree_equal((u1, s1), (u2, s2))


def test_narrow_copies_cross() -> None:
    """In the program lowered for a GPU, the state crosses to host as bfloat16 (the cast
    happens on the device, before the copy) and comes back as bfloat16."""
    params = {"w": jax.device_put(jnp.ones((32, 32)), jax.devices()[0])}
    opt = eqx_offload.offloaded(optax.adam(0.1), host_dtype=jnp.bfloat16)
    state = opt.init(params)
    text = jax.jit(opt.update).trace(params, state, params).lower(
        lowering_platforms=("cuda",)).as_text()
    placements = re.findall(
        r"annotate_device_placement\([^)]*\).*_xla_buffer_placement = \"(\w+)\".*-> tensor<([^>]*)>", text)
    assert sorted(placements) == [("device", "32x32xbf16")] * 2 + [("pinned_host", "32x32xbf16")] * 2


def test_host_dtype_is_not_applied_to_unselected_or_narrow_leaves() -> None:
    params = {"w": jnp.ones((4, 4), jnp.bfloat16), "v": jnp.ones((4, 4))}
    opt = eqx_offload.offloaded(optax.adam(0.1), eqx_offload.pattern(".*/w"), host_dtype=jnp.float16)
    state = opt.init(params)
    adam = state.inner_state[0]
    assert adam.mu["w"].dtype == jnp.bfloat16  # already 2 bytes: not touched
    assert adam.mu["v"].dtype == jnp.float32 and adam.mu["v"].sharding.memory_kind == "device"

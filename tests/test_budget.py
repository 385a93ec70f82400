"""Offloading only what must go (`within_budget`) and letting the copies overlap the
step (`prefetch_options`, and the dependency structure that allows it)."""

import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import pytest
from helpers import assert_tree_equal, unchecked

import eqx_offload


PARAMS = {"big": jnp.ones((64, 32)), "mid": jnp.ones((16, 16)), "small": jnp.ones(8), "s": jnp.ones(())}
# adam: mu and nu per parameter: big 8 KiB each, mid 1 KiB, small 32 B, s 4 B; count 4 B.


def _offloaded(budget: int) -> dict[str, str]:
    opt = eqx_offload.offloaded(optax.adam(0.1), eqx_offload.within_budget(optax.adam(0.1), PARAMS, budget))
    state = opt.init(PARAMS)
    report = eqx_offload.memory_report(state)
    assert report.device_bytes <= max(budget, 16)  # 0-d leaves always stay
    return {leaf.path: leaf.memory_kind for leaf in report.leaves}


def test_everything_fits() -> None:
    assert set(_offloaded(1 << 20).values()) == {"device"}


def test_nothing_fits() -> None:
    kinds = _offloaded(0)
    assert {p for p, k in kinds.items() if k == "device"} == {"inner_state/0/count", "inner_state/0/mu/s", "inner_state/0/nu/s"}


def test_largest_first() -> None:
    # Room for everything but one of the two 8 KiB leaves: the first big one goes.
    total = 2 * (8192 + 1024 + 32 + 4) + 4
    kinds = _offloaded(total - 8192)
    assert [p for p, k in kinds.items() if k == "pinned_host"] == ["inner_state/0/mu/big"]
    kinds = _offloaded(total - 8192 - 1)
    assert [p for p, k in kinds.items() if k == "pinned_host"] == ["inner_state/0/mu/big", "inner_state/0/nu/big"]


def test_budget_offloaded_is_bitwise_and_bad_budget_rejected() -> None:
    where = eqx_offload.within_budget(optax.adam(0.1), PARAMS, 4096)
    opt, ref = eqx_offload.offloaded(optax.adam(0.1), where), optax.adam(0.1)
    state, ref_state = opt.init(PARAMS), ref.init(PARAMS)
    updates, state = opt.update(PARAMS, state, PARAMS)
    ref_updates, ref_state = ref.update(PARAMS, ref_state, PARAMS)
    assert_tree_equal((updates, state.inner_state), (ref_updates, ref_state))
    for bad in (-1, 1.5, True):
        with pytest.raises(eqx_offload.OptionError, match="device_bytes must be an int >= 0"):
            unchecked(eqx_offload.within_budget)(optax.adam(0.1), PARAMS, bad)


def test_prefetch_options_compile_and_keep_results() -> None:
    # No budget, no options (XLA's latency-hiding scheduler is on by default on GPUs).
    assert eqx_offload.prefetch_options() == {}
    # A budget is a whole percentage of the device's memory, rounded down, at least 1%.
    assert eqx_offload.prefetch_options(3 << 30, device_memory_size=8 << 30) == {
        "xla_gpu_memory_limit_slop_factor": 37}
    assert eqx_offload.prefetch_options(1, device_memory_size=8 << 30) == {
        "xla_gpu_memory_limit_slop_factor": 1}
    # The CPU reports no memory limit: the budget needs the device's size.
    with pytest.raises(eqx_offload.OptionError, match="pass device_memory_size="):
        eqx_offload.prefetch_options(1 << 30)
    with pytest.raises(eqx_offload.OptionError, match="device_memory_size must be an int > 0"):
        unchecked(eqx_offload.prefetch_options)(1 << 30, device_memory_size=0)
    # XLA options for a GPU: the CPU compiler ignores them, and the results are the same.
    options = eqx_offload.prefetch_options(1 << 30, device_memory_size=8 << 30)
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    opt = eqx_offload.offloaded(optax.adam(0.1))

    def step(model: Any, state: Any, x: jax.Array) -> Any:
        grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    x = jnp.ones((4, 3))
    state = opt.init(eqx.filter(model, eqx.is_array))
    out = eqx_offload.filter_jit(step, compiler_options=options)(model, state, x)
    ref = eqx_offload.filter_jit(step)(model, state, x)
    assert_tree_equal(eqx.filter(out, eqx.is_array), eqx.filter(ref, eqx.is_array))
    with pytest.raises(eqx_offload.OptionError, match="int > 0"):
        unchecked(eqx_offload.prefetch_options)(0)


def _placement_operands(text: str, kind: str) -> list[str]:
    return re.findall(
        r"annotate_device_placement\((%[\w#]+)\).*_xla_buffer_placement = \"" + kind + "\"", text)


@pytest.mark.parametrize("group_bytes", [None, 0])
def test_state_copies_to_the_device_wait_for_nothing(group_bytes: Any) -> None:
    """In a whole training step lowered for a GPU, every copy of the state to the device
    reads a step argument directly: nothing (the forward and backward passes above all)
    makes it wait, so the scheduler may start it at the top of the step. With
    `group_bytes` that holds for the first group; later groups wait only for the update
    before them and earlier groups' copies back (see test_stream)."""
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    params = jax.device_put(eqx.filter(model, eqx.is_array), jax.devices()[0])
    opt = eqx_offload.offloaded(optax.adam(0.1), group_bytes=group_bytes, lookahead=1)
    state = opt.init(params)
    static = eqx.filter(model, eqx.is_array, inverse=True)

    def step(params: Any, state: Any, x: jax.Array) -> Any:
        grads = jax.grad(lambda p: jnp.sum(jax.vmap(eqx.combine(p, static))(x) ** 2))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    text = jax.jit(step).trace(params, state, jnp.ones((4, 3))).lower(
        lowering_platforms=("cuda",)).as_text()
    n_state = sum(x.ndim > 0 for x in jtu.tree_leaves(state))
    operands = _placement_operands(text, "device")
    assert len(operands) == n_state
    free = [op for op in operands if op.startswith("%arg")]
    assert len(free) == (n_state if group_bytes is None else 2)  # mu, nu of the first group


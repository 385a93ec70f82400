"""Offloading only what must go (`within_budget`) and letting the copies overlap the
step (`prefetch_options`; the dependency structure that allows it: test_stream.py)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_tree_equal, unchecked

import eqx_offload


PARAMS = {"big": jnp.ones((64, 32)), "mid": jnp.ones((16, 16)), "small": jnp.ones(8),
          "s": jnp.ones(())}
# adam's mu and nu per parameter: big 8 KiB each, mid 1 KiB, small 32 B, s 4 B; count 4 B.
TOTAL = 2 * (8192 + 1024 + 32 + 4) + 4
NOT_SCALARS = [f"inner_state/0/{m}/{k}" for m in ("mu", "nu") for k in ("big", "mid", "small")]


@pytest.mark.parametrize("budget, on_host", [
    (1 << 20, []),
    (0, NOT_SCALARS),  # 0-d leaves always stay
    # room for all but one 8 KiB leaf: the first big one goes (largest first)
    (TOTAL - 8192, ["inner_state/0/mu/big"]),
    (TOTAL - 8192 - 1, ["inner_state/0/mu/big", "inner_state/0/nu/big"]),
])
def test_within_budget(budget: int, on_host: list[str]) -> None:
    where = eqx_offload.stream.within_budget(optax.adam(0.1), PARAMS, budget)
    opt = eqx_offload.offloaded(optax.adam(0.1), where)
    report = eqx_offload.memory_report(opt.init(PARAMS))
    assert report.device_bytes <= max(budget, 16)
    assert [leaf.path for leaf in report.leaves if leaf.memory_kind == "pinned_host"] == on_host
    assert {leaf.memory_kind for leaf in report.leaves} <= {"device", "pinned_host"}


def test_budget_offloaded_is_bitwise_and_bad_budget_rejected() -> None:
    where = eqx_offload.stream.within_budget(optax.adam(0.1), PARAMS, 4096)
    opt, ref = eqx_offload.offloaded(optax.adam(0.1), where), optax.adam(0.1)
    updates, state = opt.update(PARAMS, opt.init(PARAMS), PARAMS)
    assert_tree_equal((updates, state.inner_state), ref.update(PARAMS, ref.init(PARAMS), PARAMS))
    for bad in (-1, 1.5, True):
        with pytest.raises(eqx_offload.errors.OptionError, match="device_bytes must be an int >= 0"):
            unchecked(eqx_offload.stream.within_budget)(optax.adam(0.1), PARAMS, bad)


def test_prefetch_options_compile_and_keep_results() -> None:
    """A budget is a whole percentage of device memory; results unchanged."""
    assert eqx_offload.stream.prefetch_options() == {}
    slop = "xla_gpu_memory_limit_slop_factor"
    assert eqx_offload.stream.prefetch_options(3 << 30, device_memory_size=8 << 30) == {slop: 37}
    assert eqx_offload.stream.prefetch_options(1, device_memory_size=8 << 30) == {slop: 1}
    with pytest.raises(eqx_offload.errors.OptionError, match="pass device_memory_size="):
        eqx_offload.stream.prefetch_options(1 << 30)
    with pytest.raises(eqx_offload.errors.OptionError, match="device_memory_size must be an int > 0"):
        unchecked(eqx_offload.stream.prefetch_options)(1 << 30, device_memory_size=0)
    with pytest.raises(eqx_offload.errors.OptionError, match="int > 0"):
        unchecked(eqx_offload.stream.prefetch_options)(0)
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    opt = eqx_offload.offloaded(optax.adam(0.1))

    def step(model: Any, state: Any, x: jax.Array) -> Any:
        grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.filter(eqx.apply_updates(model, updates), eqx.is_array), state

    options = eqx_offload.stream.prefetch_options(1 << 30, device_memory_size=8 << 30)
    args = (model, opt.init(eqx.filter(model, eqx.is_array)), jnp.ones((4, 3)))
    assert_tree_equal(eqx_offload.filter_jit(step, compiler_options=options)(*args),
                      eqx_offload.filter_jit(step)(*args))

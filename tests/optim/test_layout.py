"""Where `offloaded` stores a state (`_optim/layout.py`): each leaf placed inside the compiled
`init`, and `host_dtype` narrowing what crosses and rests in host memory."""

import re

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import pytest
from helpers import assert_placed

import eqx_offload


def test_init_state_never_whole_on_device() -> None:
    """`init` is one program whose state outputs are already in host memory."""
    params = {"w": jnp.ones((3, 4)), "b": jnp.ones(4), "s": jnp.asarray(0.5)}
    opt = eqx_offload.offloaded(optax.adamw(0.1))
    jaxpr = jax.make_jaxpr(opt.init)(params)
    # mu and nu of "w" and "b" are host outputs; count and the 0-d "s" moments are not.
    assert [v.aval.memory_space for v in jaxpr.jaxpr.outvars].count(jax.memory.Space.Host) == 4
    compiled = jax.jit(opt.init).lower(params).compile()
    kinds = [s.memory_kind for s in jtu.tree_leaves(compiled.output_shardings)]
    assert kinds.count("pinned_host") == 4 and kinds.count("device") == 3
    assert_placed(opt.init(params))


@pytest.mark.both
def test_host_bytes_halved() -> None:
    params = {"w": jnp.ones((64, 64))}
    full = eqx_offload.offloaded(optax.adam(0.1)).init(params)
    half = eqx_offload.offloaded(optax.adam(0.1), host_dtype=jnp.bfloat16).init(params)
    full_bytes = eqx_offload.memory_report(full).host_bytes
    assert eqx_offload.memory_report(half).host_bytes * 2 == full_bytes == 2 * 64 * 64 * 4


@pytest.mark.both
def test_narrow_copies_cross() -> None:
    """Lowered for a GPU, the state crosses both ways as bfloat16 (cast on the device)."""
    params = {"w": jax.device_put(jnp.ones((32, 32)), jax.devices()[0])}
    opt = eqx_offload.offloaded(optax.adam(0.1), host_dtype=jnp.bfloat16)
    text = jax.jit(opt.update).trace(params, opt.init(params), params).lower(
        lowering_platforms=("cuda",)).as_text()
    placements = re.findall(r"annotate_device_placement\([^)]*\).*_xla_buffer_placement = "
                            r"\"(\w+)\".*-> tensor<([^>]*)>", text)
    assert sorted(placements) == [("device", "32x32xbf16")] * 2 + [("pinned_host", "32x32xbf16")] * 2


@pytest.mark.both
def test_host_dtype_is_not_applied_to_unselected_or_narrow_leaves() -> None:
    params = {"w": jnp.ones((4, 4), jnp.bfloat16), "v": jnp.ones((4, 4))}
    opt = eqx_offload.offloaded(optax.adam(0.1), eqx_offload.pattern(".*/w"), host_dtype=jnp.float16)
    adam = opt.init(params).inner_state[0]
    assert adam.mu["w"].dtype == jnp.bfloat16  # already 2 bytes: not touched
    assert adam.mu["v"].dtype == jnp.float32 and adam.mu["v"].sharding.memory_kind == "device"


@pytest.mark.parametrize("group_bytes, top_level_puts", [("auto", 0), (None, 4), (1024, 4)])
def test_state_crosses_once_each_way(group_bytes, top_level_puts) -> None:
    """Traced, each host leaf is fetched once and stored once: `offloaded`'s store after
    a strategy that stored already moves nothing (one copy each way in XLA's program
    for a GPU; `auto` moves only inside its `platform_dependent` branches)."""
    params = {"w": jax.device_put(jnp.ones((32, 32)), jax.devices()[0])}
    opt = eqx_offload.offloaded(optax.adam(0.1), group_bytes=group_bytes)
    state = opt.init(params)
    traced = jax.jit(opt.update).trace(params, state, params)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    placements = re.findall(r"_xla_buffer_placement = \"(\w+)\"", text)
    assert sorted(placements) == ["device"] * 2 + ["pinned_host"] * 2
    puts = [len(e.invars) for e in jax.make_jaxpr(opt.update)(params, state, params).eqns
            if e.primitive.name == "device_put"]
    assert sum(puts) == top_level_puts  # mu and nu: fetched, stored

"""A step compiled beside the start-up (docs/startup.md): compiled ahead of time from
`filter_eval_shape` of the function that makes the model, in a thread while
`filter_make` makes it, the executable takes `filter_make`'s arrays as they are (no
further compile), and its result is bitwise the sequential route's (the model made,
then the step called); for a v5e, the step lowered so keeps the host leaves in host
memory."""

import concurrent.futures
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_tree_equal, count_compiles, tpu_plan_marks, v5e

import eqx_offload


pytestmark = pytest.mark.both  # (shardings of abstract and made arrays: JAX-version dependent)


class _Deep(eqx.Module):
    blocks: eqx.nn.Linear  # stacked: 4 layers
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        kb, kh = jax.random.split(key)
        self.blocks = eqx_offload.stack_layers(lambda k: eqx.nn.Linear(32, 32, key=k),
                                               jax.random.split(kb, 4))
        self.head = eqx.nn.Linear(32, 1, key=kh)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(eqx_offload.scan_layers(self.blocks, x))


# bf16 blocks in host memory; their fp32 master and the state in host memory, the
# head's made whole (one group a leaf) and the blocks' a layer at a time
_MW = eqx_offload.master_weights(optax.adamw(1e-3),
                                 offload=lambda t: eqx_offload.offloaded(t, group_bytes=0))


def _start(key: jax.Array) -> Any:
    deep = eqx.tree_at(lambda m: m.blocks, _Deep(key), replace_fn=eqx_offload.to_host)
    return _MW.init(deep)


@eqx_offload.filter_jit(donate=("model", "state"))
def _step(model: Any, state: Any, x: jax.Array) -> Any:
    loss = lambda m: jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2)  # noqa: E731
    return _MW.update(eqx.filter_grad(loss)(model), state, model)


def _key(placed: str) -> jax.Array:
    key = jax.random.key(5)
    if placed == "mesh":  # (a key over a one-device mesh, as bench/train.py gives it)
        mesh = jax.sharding.Mesh(jax.devices()[:1], ("_",))
        key = jax.device_put(key, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return key


@pytest.mark.parametrize("placed", ["default", "mesh"])
def test_a_step_compiled_beside_filter_make_takes_its_arrays(placed: str) -> None:
    key, x = _key(placed), jnp.ones((4, 32), jnp.bfloat16)
    lowered = _step.lower(*eqx_offload.checkpoint.filter_eval_shape(_start, key), x)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        compiling = pool.submit(lowered.compile)
        model, state = eqx_offload.filter_make(_start, key)
        compiled = compiling.result()
    assert model.blocks.weight.sharding.memory_kind == "pinned_host"
    assert state.inner_state.master.head.weight.sharding.memory_kind == "pinned_host"
    with count_compiles() as compiles:
        beside = jax.block_until_ready(compiled(model, state, x))
    assert compiles == []
    assert model.blocks.weight.is_deleted()  # (the compiled step donates, as the call)
    # the sequential route: made, then the step called (it compiles there)
    model, state = eqx_offload.filter_make(_start, key)
    with count_compiles("_step") as compiles:
        sequential = _step(model, state, x)
    assert len(compiles) == 1
    assert_tree_equal(beside, sequential)


@pytest.mark.parametrize("target", [pytest.param("v5e", marks=tpu_plan_marks())])
def test_the_step_compiled_ahead_for_a_v5e_keeps_host_leaves_in_host_memory(target: str) -> None:
    """For a v5e without one (libtpu): the abstract model and state of a key on the chip
    (a `SingleDeviceSharding`, as on a TPU's default device) give host leaves over a
    one-device mesh, which the step lowered from them takes in host memory."""
    on = jax.sharding.SingleDeviceSharding(v5e())
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=on)
    abstract = eqx_offload.checkpoint.filter_eval_shape(_start, key)
    x = jax.ShapeDtypeStruct((4, 32), jnp.bfloat16, sharding=on)
    lowered = _step.lower(*abstract, x)
    kinds = [a.sharding.memory_kind for a in jax.tree.leaves((*abstract, x))]
    spaces = [a.memory_space for a in lowered.jaxpr.in_avals]
    assert "pinned_host" in kinds and spaces == [
        jax.memory.Space.Host if k == "pinned_host" else jax.memory.Space.Device for k in kinds]
    assert lowered.compile().memory_analysis().host_argument_size_in_bytes > 0

"""A step compiled beside the start-up (docs/startup.md): compiled ahead of time from
`filter_eval_shape` of the function that makes the model, in a thread while
`filter_make` makes it, the executable takes `filter_make`'s arrays as they are (no
further compile), and its result is bitwise the sequential route's (the model made,
then the step called)."""

import concurrent.futures
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_tree_equal, count_compiles

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
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        compiling = pool.submit(lambda: _step.lower(
            *eqx_offload.checkpoint.filter_eval_shape(_start, key), x).compile())
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

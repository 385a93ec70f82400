"""`checkpoint.abstract_init` of `update_in_backward(...)`: the restore target of the
state its `init` makes, every leaf's shape, dtype and memory kind, without making it."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload
from eqx_offload import checkpoint


class Model(eqx.Module):
    embed: jax.Array
    blocks: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.sum(eqx_offload.scan_layers(self.blocks, x * self.embed))


def _model() -> Model:
    ke, kb = jax.random.split(jax.random.key(0))
    return Model(jax.random.normal(ke, (8,)),
                 eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(jax.random.split(kb, 3)))


def _described(tree: Any) -> Any:
    return jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding.memory_kind), tree)


@pytest.mark.parametrize("optimizer", [
    eqx_offload.offloaded(optax.adamw(1e-2)),
    eqx_offload.master_weights(optax.adamw(1e-2)),
], ids=["offloaded", "master_weights"])
def test_abstract_init_is_the_state_init_makes(optimizer: Any) -> None:
    opt = eqx_offload.update_in_backward(optimizer, layers=lambda m: m.blocks)
    abstract_model = eqx.filter_eval_shape(_model)
    target = checkpoint.abstract_init(opt, abstract_model)
    _, state = opt.init(_model())
    assert jax.tree.structure(target) == jax.tree.structure(state)
    assert _described(target) == _described(state)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(target))

"""`filter_make` is bitwise the compiled call of its function (`eqx.filter_jit(fun)`),
on a user's embedding table, Equinox layers and stacked layers; and the mistakes a user
makes with `filter_make` and `stack_layers` get errors that name the fix first."""

from typing import Any

import equinox as eqx
import jax
import pytest
from helpers import assert_tree_equal, memory_kinds

import eqx_offload
from eqx_offload.errors import OptionError


def _table(key: jax.Array) -> dict[str, jax.Array]:
    """A GPT-2 embedding table as a user writes it: a normal times the init scale."""
    return {"emb": jax.random.normal(key, (512, 64)) * 0.02}


def _layers(key: jax.Array) -> Any:
    """Equinox layers, stacked blocks made by `stack_layers`, some in host memory."""
    ke, kb, kh = jax.random.split(key, 3)
    blocks = eqx_offload.stack_layers(lambda k: eqx.nn.MLP(16, 16, 32, 1, key=k),
                                      jax.random.split(kb, 3))
    return {"embed": eqx.nn.Embedding(96, 16, key=ke),
            "blocks": eqx_offload.to_host(blocks),
            "norm": eqx.nn.LayerNorm(16),
            "head": eqx.nn.Linear(16, 96, key=kh)}


@pytest.mark.parametrize("fun", [_table, _layers], ids=["table", "layers"])
def test_bitwise_the_compiled_call(fun: Any) -> None:
    key = jax.random.key(0)
    made = eqx_offload.filter_make(fun, key)
    compiled = eqx.filter_jit(fun)(key)
    assert_tree_equal(made, compiled)
    assert memory_kinds(made) == memory_kinds(compiled)


def _error(call: Any) -> str:
    with pytest.raises(OptionError) as info:
        call()
    message = str(info.value)
    assert len(message.splitlines()) <= 4 and "models/#start-up" in message
    return message


def test_a_model_where_the_function_goes() -> None:
    key = jax.random.key(0)
    model = eqx.nn.Linear(4, 4, key=key)
    message = _error(lambda: eqx_offload.filter_make(model, key))
    assert message.startswith("Pass the function that makes the model, not the model")
    assert "got a Linear with array leaves" in message
    # A module without arrays that makes the model (a partial constructor) is a function.
    made = eqx_offload.filter_make(eqx.Partial(eqx.nn.Linear, 4, 4), key=key)
    assert_tree_equal(made, eqx.filter_jit(eqx.nn.Linear)(4, 4, key=key))


@pytest.mark.parametrize("one_key", [jax.random.key(0), jax.random.PRNGKey(0)],
                         ids=["typed", "raw"])
def test_one_key_where_one_per_layer_goes(one_key: jax.Array) -> None:
    def make_layer(k: jax.Array) -> eqx.nn.Linear:
        return eqx.nn.Linear(4, 4, key=k)

    message = _error(lambda: eqx_offload.stack_layers(make_layer, one_key))
    assert message.startswith("Pass one key per layer: `stack_layers(make_layer, "
                              "jax.random.split(key, L))`")
    _error(lambda: eqx_offload.filter_make(
        lambda k: eqx_offload.stack_layers(make_layer, k), one_key))
    stacked = eqx_offload.stack_layers(make_layer, jax.random.split(one_key, 3))
    assert stacked.weight.shape == (3, 4, 4)

"""`filter_jit(model)`: a module as the jitted function. Its arrays are traced (as
`eqx.filter_jit` traces them), not baked into the program as constants, and never
donated."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import assert_tree_equal

import eqx_offload


def _mlp() -> eqx.nn.MLP:
    # 83,008 parameters: as constants they would be ~800,000 characters of program.
    return eqx.nn.MLP(64, 64, 256, 2, key=jax.random.key(0))


def test_a_modules_arrays_are_arguments_not_constants() -> None:
    model = _mlp()
    x = jnp.ones(64)
    lowered = eqx_offload.filter_jit(model).lower(x)
    n_arrays = len(jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    assert len(lowered.jaxpr.jaxpr.invars) == n_arrays + 1
    assert not lowered.jaxpr.consts
    assert len(lowered.as_text()) < 2 * len(eqx.filter_jit(model).lower(x).as_text())
    assert_tree_equal(eqx_offload.filter_jit(model)(x), eqx.filter_jit(model)(x))
    assert_tree_equal(lowered.compile()(x), model(x))


@pytest.mark.parametrize("donate", ["all", "all-except-first", "warn"])
def test_a_modules_arrays_are_never_donated(donate: str) -> None:
    model = _mlp()
    jitted = eqx_offload.filter_jit(model, donate=donate)
    x = jnp.ones(64)
    first = jitted(x)
    assert not any(a.is_deleted() for a in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    assert x.is_deleted() == (donate != "all-except-first")
    assert_tree_equal(jitted(jnp.ones(64)), first)


def test_a_bound_method_and_a_partial_with_arrays_are_traced() -> None:
    class Scale(eqx.Module):
        w: jax.Array

        def apply(self, x: jax.Array) -> jax.Array:
            return self.w * x

    scale = Scale(jnp.arange(1000.0))
    for fun in (scale.apply, eqx.Partial(lambda w, x: w * x, scale.w)):
        lowered = eqx_offload.filter_jit(fun).lower(jnp.ones(1000))
        assert not lowered.jaxpr.consts and len(lowered.jaxpr.jaxpr.invars) == 2
        assert_tree_equal(eqx_offload.filter_jit(fun)(jnp.ones(1000)), jnp.arange(1000.0))


def test_a_host_model_as_the_function_names_its_weight() -> None:
    model = eqx_offload.to_host(_mlp())
    with pytest.raises(eqx_offload.errors.CompositionError) as caught:
        eqx_offload.filter_jit(model)(jnp.ones(64))
    assert "`<fun>`, leaf .layers[0].weight" in str(caught.value)

"""What `filter_jit` (and `eqx_offload.jit`) says of an operation on a host-memory
operand, by where the operand came from: an optimizer state read without its
`OffloadedState`, a model's weight, a value the step made."""

import equinox as eqx
import jax
import optax
import pytest
from helpers import assert_tree_equal

import eqx_offload


def _model() -> eqx.nn.MLP:
    return eqx.nn.MLP(4, 1, 8, 1, key=jax.random.key(0))


def test_a_state_read_from_its_inner_state_gets_the_states_fix() -> None:
    """Optax's schedule-free evaluation on `state.inner_state` (a `NamedTuple` whose
    leaves are the parameters' modules): the state's message, not the weights'."""
    params = eqx.filter(_model(), eqx.is_array)
    state = eqx_offload.offloaded(optax.contrib.schedule_free_adamw(1e-2)).init(params)
    with pytest.raises(eqx_offload.errors.CompositionError,
                       match="^Bring what the step reads from the optimizer state"):
        eqx_offload.jit(optax.contrib.schedule_free_eval_params)(state.inner_state, params)
    evaluated = jax.jit(optax.contrib.schedule_free_eval_params)
    assert_tree_equal(evaluated(eqx_offload.to_device(state.inner_state), params),
                      evaluated(state, params))


def test_host_weights_read_by_another_function_get_the_weights_fix() -> None:
    host_model = eqx_offload.to_host(_model())
    optimizer = eqx_offload.host_weights_optimizer(optax.contrib.schedule_free_adamw(1e-2))
    state = optimizer.init(host_model)
    params = eqx.filter(host_model, eqx.is_array)
    with pytest.raises(eqx_offload.errors.CompositionError) as caught:
        eqx_offload.jit(optax.contrib.schedule_free_eval_params)(state, params)
    assert ".layers[0].weight (not an optimizer state)" in str(caught.value)
    assert str(caught.value).startswith("Keep model weights in host memory")

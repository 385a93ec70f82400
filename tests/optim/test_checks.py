"""`offloaded`'s state checks: never refuse a state it made; name the leaf of one it did not."""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import pytest
from helpers import assert_placed, assert_tree_equal

import eqx_offload


class _ScalarState(NamedTuple):
    count: int
    scale: float
    mu: Any


def _python_scalar_state() -> optax.GradientTransformation:
    """A transformation whose state holds Python scalars (as some of optax's tests do)."""

    def update_fn(updates: Any, state: _ScalarState, params: Any = None) -> Any:
        mu = jtu.tree_map(lambda m, u: state.scale * m + u, state.mu, updates)
        return mu, _ScalarState(state.count + 1, state.scale, mu)

    return optax.GradientTransformation(
        lambda params: _ScalarState(0, 0.5, jtu.tree_map(jnp.zeros_like, params)), update_fn)


@pytest.mark.filterwarnings("ignore:filter_jit.*Python int:eqx_offload.errors.OffloadWarning")
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_python_scalars_in_state_not_rejected(mode: str) -> None:
    """A state with Python scalars made by this optimizer is never a `StateError`."""
    params = {"w": jnp.arange(4.0)}
    opt, inner = eqx_offload.offloaded(_python_scalar_state()), _python_scalar_state()
    update = opt.update if mode == "eager" else eqx_offload.filter_jit(opt.update)
    state, ref_state = opt.init(params), inner.init(params)
    for _ in range(3):
        updates, state = update(params, state, params)
        ref_updates, ref_state = inner.update(params, ref_state, params)
        assert_tree_equal(updates, ref_updates)
    assert_tree_equal(state.inner_state.mu, ref_state.mu)
    assert_placed(state)


class _Counted(NamedTuple):
    seen: Any


def _counting(calls: list[int]) -> optax.GradientTransformation:
    """Sums into a state that gains an entry at the first update; counts calls of `update`."""

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        calls.append(1)
        return updates, _Counted({"sum": jax.tree.map(jnp.add, state.seen["sum"], updates),
                                  "last": updates})

    return optax.GradientTransformation(
        lambda p: _Counted({"sum": jax.tree.map(jnp.zeros_like, p)}), update)


def test_grown_state_is_checked_once_not_every_eager_step() -> None:
    """One call of `inner.update` per step, plus one abstract trace for the grown state."""
    calls: list[int] = []
    opt = eqx_offload.offloaded(_counting(calls), where=True)
    params = {"w": jnp.arange(3.0)}
    state = opt.init(params)
    for _ in range(6):
        _, state = opt.update(params, state, params)
    assert len(calls) == 6 + 1
    assert_placed(state, True)


def test_acceptance_does_not_depend_on_earlier_init_calls() -> None:
    """Another `offloaded(...)` that never ran `init` accepts the state (updates per example)."""
    def init(params: Any) -> Any:
        return _Counted(jax.tree.map(jnp.zeros_like, params))

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        mean = jax.tree.map(lambda u: jnp.mean(u, axis=0), updates)
        return mean, _Counted(jax.tree.map(jnp.add, state.seen, mean))

    inner = optax.GradientTransformation(init, update)
    made = eqx_offload.offloaded(inner, where=True).init({"w": jnp.zeros(3)})
    per_example = {"w": jnp.ones((5, 3))}
    updates, state = eqx_offload.offloaded(inner, where=True).update(per_example, made)
    ref = inner.update(per_example, init({"w": jnp.zeros(3)}))
    assert_tree_equal((updates, state.inner_state), ref)


def test_a_state_for_other_params_that_would_broadcast_is_refused() -> None:
    """A (1,) moment against (3,) updates (which `inner.update` would broadcast)."""
    opt = eqx_offload.offloaded(optax.adam(1e-3))
    state = opt.init({"w": jnp.ones(1)})
    match = r"leaf inner_state/0/mu/w is float32\[1\], but `inner.update` makes it float32\[3\]"
    with pytest.raises(eqx_offload.errors.StateError, match=match):
        opt.update({"w": jnp.ones(3)}, state, {"w": jnp.ones(3)})


def test_another_optimizers_state_names_the_difference_and_the_update_error() -> None:
    adam = eqx_offload.offloaded(optax.adam(1e-3))
    state = eqx_offload.offloaded(optax.sgd(1e-3, momentum=0.9)).init({"w": jnp.ones(3)})
    with pytest.raises(eqx_offload.errors.StateError) as info:
        adam.update({"w": jnp.ones(3)}, state, {"w": jnp.ones(3)})
    assert "at path inner_state/0 the expected state has ScaleByAdamState" in str(info.value)
    assert "`inner.update` cannot run on it either: AttributeError" in str(info.value)


def test_a_state_that_differs_after_the_first_update_is_still_checked() -> None:
    """The checks skipped on the happy path run for other structures, shapes, memory kinds."""
    params = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
    opt = eqx_offload.offloaded(optax.adam(1e-3))
    _, state = opt.update(params, opt.init(params), params)
    other = opt.init({"w": jnp.ones((3, 2)), "b": jnp.ones(3)})
    with pytest.raises(eqx_offload.errors.StateError, match=r"leaf inner_state/0/mu/w is float32\[3, 2\]"):
        opt.update(params, other, params)
    with pytest.raises(eqx_offload.errors.StateError, match="does not belong to this optimizer"):
        opt.update(params, eqx_offload.offloaded(optax.sgd(1e-3, momentum=0.9)).init(params), params)
    with pytest.warns(eqx_offload.errors.OffloadWarning, match=r"inner_state/0/mu/b is in device memory"):
        _, state = opt.update(params, eqx_offload.to_device(state), params)
    assert_placed(state)


def test_an_eager_update_with_a_state_a_donating_step_consumed() -> None:
    """The state passed to a donating step, updated again eagerly: a `DonationError` with
    the fix first, naming `state` and the leaf (JAX: "Array has been deleted")."""
    params = {"w": jnp.ones((2, 3))}
    opt = eqx_offload.offloaded(optax.adam(1e-3))

    @eqx_offload.filter_jit(donate="all")
    def step(params: Any, state: Any) -> Any:
        updates, state = opt.update(params, state, params)
        return optax.apply_updates(params, updates), state

    old = opt.init(params)
    opt.update(params, old, params)  # (its layout is known: the check is not the first)
    params, state = step(params, old)
    with pytest.raises(eqx_offload.errors.DonationError) as caught:
        opt.update(params, old, params)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("Pass the value the donating call returned in its place")
    assert lines[1].startswith("offloaded(...).update: state, leaf .inner_state[0].count")
    assert len(lines) == 3 and isinstance(caught.value, RuntimeError)
    opt.update(params, state, params)  # the state the step returned


class _Block(eqx.Module):
    """A block of Equinox's BERT example: a linear layer and a dropout (its rate a float)."""

    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key: jax.Array) -> None:
        self.linear = eqx.nn.Linear(3, 3, key=key)
        self.dropout = eqx.nn.Dropout(p=0.1)

    def __call__(self, x: jax.Array, key: jax.Array) -> jax.Array:
        return self.dropout(self.linear(x), key=key)


def test_init_on_a_model_with_a_float_leaf_names_the_leaf_and_the_fix() -> None:
    """`tx.init(model)` with the dropout rate among the leaves: the update's gradient has
    `None` there. The `StateError` says to initialise with the arrays, names the leaf."""
    model = _Block(jax.random.key(0))
    tx = eqx_offload.offloaded(optax.adam(1e-3))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(3), jax.random.key(1))))(model)
    with pytest.raises(eqx_offload.errors.StateError) as caught:
        tx.update(grads, tx.init(model), model)
    lines = str(caught.value).splitlines()
    assert lines[0] == ("Initialise with the model's arrays only: "
                        "`tx.init(eqx.filter(model, eqx.is_array))`.")
    assert lines[1].startswith("offloaded(...).update(updates=...): leaf .dropout.")
    assert "inner_state/0/mu/dropout/" in lines[1] and len(lines) == 3
    updates, _ = tx.update(grads, tx.init(eqx.filter(model, eqx.is_array)), model)
    assert updates.dropout.p is None

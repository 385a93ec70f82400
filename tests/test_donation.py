"""`filter_jit`'s donation (`_donation.py`): a failed call (an error while tracing, a bad
or stale state) leaves the donated inputs intact; a buffer shared by several arguments is
donated once (the ported DCGAN programs too). The donation matrix, with the arguments in
both orders: test_jit.py."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import pytest
from helpers import assert_tree_equal, count_compiles, tree_bits as bits
from ports import dcgan, dcgan_example
from test_ports import _assert_same_run

import eqx_offload


# ---------------------------------------------------------------------------------------
# A failed call keeps the donated inputs


class Model(eqx.Module):
    w: jax.Array
    b: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w + self.b


def setup() -> tuple[Model, optax.GradientTransformation, Any]:
    model = Model(jnp.arange(6.0).reshape(3, 2) / 7, jnp.ones(2) / 3)
    opt = eqx_offload.offloaded(optax.adamw(1e-2))
    return model, opt, opt.init(eqx.filter(model, eqx.is_array))


def make_step(opt: optax.GradientTransformation, fail: list[bool]) -> Callable[..., Any]:
    @eqx_offload.filter_jit(donate="all")
    def step(model: Model, state: Any, x: jax.Array) -> tuple[Model, Any]:
        if fail and fail[0]:
            raise RuntimeError("a bug in the step function")
        grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    return step


def reference(n: int) -> tuple[Model, Any]:
    model, opt, state = setup()
    step = make_step(opt, [])
    for _ in range(n):
        model, state = step(model, state, jnp.ones((4, 3)))
    return model, state


def intact(*trees: Any) -> bool:
    return not any(x.is_deleted() for x in jtu.tree_leaves(trees))


def test_error_while_tracing_keeps_donated_inputs() -> None:
    model, opt, state = setup()
    fail = [True]
    step = make_step(opt, fail)
    with pytest.raises(RuntimeError, match="a bug in the step function"):
        step(model, state, jnp.ones((4, 3)))
    assert intact(model, state)
    fail[0] = False  # fixed: training goes on from the same model and state
    for _ in range(2):
        model, state = step(model, state, jnp.ones((4, 3)))
    assert bits((model, state)) == bits(reference(2))


def test_bad_state_keeps_donated_inputs() -> None:
    model, opt, state = setup()
    step = make_step(opt, [])
    model, state = step(model, state, jnp.ones((4, 3)))
    # A bug: the state of another optimizer.
    wrong = eqx_offload.offloaded(optax.sgd(1e-2, momentum=0.9)).init(eqx.filter(model, eqx.is_array))
    with pytest.raises(eqx_offload.StateError, match="does not belong to this optimizer"):
        step(model, wrong, jnp.ones((4, 3)))
    assert intact(model, state, wrong)
    with pytest.raises(TypeError):  # a batch of the wrong shape: fails while tracing
        step(model, state, jnp.ones((4, 5)))
    assert intact(model, state)
    model, state = step(model, state, jnp.ones((4, 3)))
    assert bits((model, state)) == bits(reference(2))


def test_stale_state_keeps_the_other_inputs() -> None:
    """A state an earlier step donated fails before anything runs; the model survives."""
    model, opt, state = setup()
    step = make_step(opt, [])
    model, new_state = step(model, state, jnp.ones((4, 3)))
    assert not intact(state)
    with pytest.raises(RuntimeError, match="deleted"):
        step(model, state, jnp.ones((4, 3)))
    assert intact(model, new_state)
    model, new_state = step(model, new_state, jnp.ones((4, 3)))
    assert bits((model, new_state)) == bits(reference(2))


# ---------------------------------------------------------------------------------------
# A buffer shared by several arguments


def _double(a: Any, b: Any) -> Any:
    return a * 2, b + 1


def test_a_shared_buffer_is_donated_once() -> None:
    x = jnp.arange(4.0)
    step = eqx_offload.filter_jit(_double, donate="all")
    with count_compiles() as compiled:
        a, b = step(x, x)  # one buffer at two donated leaves
        assert x.is_deleted()
        y, z = jnp.arange(4.0), jnp.arange(4.0)
        c, d = step(y, z)  # two buffers: the same executable
    assert len(compiled) == 1
    assert_tree_equal((a, b), (c, d))
    assert_tree_equal((a, b), (jnp.arange(4.0) * 2, jnp.arange(4.0) + 1))


def test_a_buffer_shared_with_an_undonated_argument_survives() -> None:
    x = jnp.arange(4.0)
    step = eqx_offload.filter_jit(_double, donate="all-except-first")
    a, b = step(x, x)
    assert not x.is_deleted()  # the first argument is never donated
    assert_tree_equal((a, b), (x * 2, x + 1))


def test_a_shared_host_buffer_is_donated_once() -> None:
    opt = eqx_offload.offloaded(optax.adam(1e-2))
    params = {"w": jnp.ones((2, 3))}
    state = opt.init(params)

    @eqx_offload.filter_jit(donate="all")
    def step(params, state, same_state):
        updates, state = opt.update(params, state, params)
        return optax.apply_updates(params, updates), state

    ref = optax.adam(1e-2)
    ref_updates, ref_state = ref.update(params, ref.init(params), params)
    new_params, new_state = step(params, state, state)
    assert_tree_equal(new_state.inner_state, ref_state)
    assert all(x.is_deleted() for x in jax.tree.leaves(state))


@pytest.mark.slow
@pytest.mark.parametrize("program", [dcgan, dcgan_example])
def test_dcgan_shared_buffers_donated(program: Any) -> None:
    """The models' states share their arrays: plain `eqx.filter_jit` cannot donate
    them; the port (DCGAN: `donate="all"`; the example as written: each step donating
    by name what it returns) is bitwise the undonated plain run and consumes every input."""
    with pytest.raises(Exception, match="donate the same buffer twice"):
        program.train(False, donate="all")
    deleted: list[bool] = []
    ported = program.train(True, donate="all" if program is dcgan else "returned", deleted=deleted)
    plain = program.train(False, donate="none")
    _assert_same_run(plain, ported)
    assert deleted == [True] * program.STEPS
    if program is dcgan_example:
        assert ported.compiles == plain.compiles == [2] + [0] * (program.STEPS - 1)

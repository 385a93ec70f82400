"""`eqx_offload.jit`: `jax.jit`'s rules (static and donated arguments by number and
name, Python scalars traced weakly typed) with memory-kind-safe donation. The Flax
linen `TrainState` port is in tests/ports/linen_trainstate.py."""

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import pytest
from helpers import assert_tree_equal, count_compiles, hex_bits, kind_list
from isolated import call_isolated

import eqx_offload


def _scaled(x: jax.Array, scale: Any, power: Any) -> Any:
    return {"y": x * scale + power, "scale": scale, "n": 3}


def test_python_scalars_are_traced_weakly_as_jax_jit_traces_them() -> None:
    """A new Python scalar value does not recompile; results (dtype, weak type) are jax.jit's;
    Python scalar outputs come back as arrays."""
    x = jnp.arange(4.0, dtype=jnp.bfloat16)
    ours, theirs = eqx_offload.jit(_scaled), jax.jit(_scaled)
    with count_compiles() as compiled:
        for scale, power in [(2.0, 1), (0.5, 3), (-1.5, 7)]:
            got, want = ours(x, scale, power), theirs(x, scale, power)
            assert_tree_equal(want, got)
            assert [jax.typeof(a).weak_type for a in jtu.tree_leaves(got)] == [
                jax.typeof(a).weak_type for a in jtu.tree_leaves(want)] == [True, True, False]
    assert compiled == ["jit(_scaled)"] * 2  # once each


def _make_branchy() -> Any:
    def _branchy(x: jax.Array, n: int, *, mode: str = "add") -> jax.Array:
        for _ in range(n):  # a static int: Python control flow
            x = x + 1 if mode == "add" else x * 2
        return x

    return _branchy  # (a new function for each test: JAX caches by function)


@pytest.mark.parametrize("options", [
    {"static_argnums": 1, "static_argnames": "mode"}, {"static_argnames": ("n", "mode")},
    {"static_argnums": (-1,), "static_argnames": "mode"}])
def test_static_arguments_by_number_and_name(options: dict[str, Any]) -> None:
    ours = eqx_offload.jit(_make_branchy(), **options)
    theirs = jax.jit(_make_branchy(), **options)
    x = jnp.arange(3.0)
    with count_compiles("_branchy") as compiled:
        for n, mode in [(2, "add"), (3, "add"), (2, "mul"), (2, "add")]:
            assert_tree_equal(theirs(x, n, mode=mode), ours(x, n, mode=mode))
    assert len(compiled) == 2 * 3  # one per static configuration, each jit


def test_static_and_donated_at_once_is_refused() -> None:
    with pytest.raises(eqx_offload.errors.OptionError, match="static and donated"):
        eqx_offload.jit(_make_branchy(), static_argnums=0, donate_argnames="x")


def _run(jit: Any, offload: bool, options: dict[str, Any]) -> dict[str, Any]:
    opt = eqx_offload.offloaded(optax.adam(1e-2)) if offload else optax.adam(1e-2)

    def _adam_step(state: tuple[Any, Any, Any], x: jax.Array, lr: Any) -> tuple[Any, Any]:
        params, opt_state, count = state
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        updates = jtu.tree_map(lambda u: u * lr, updates)
        return (optax.apply_updates(params, updates), opt_state, count + 1), grads

    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)}
    state = (params, opt.init(params), 0)
    step = jit(_adam_step, **options)
    deleted, kinds = [], []
    with count_compiles("_adam_step") as compiled:
        for i in range(4):
            x = jnp.full((2, 3), 0.1 * (i + 1))
            old = state
            state, grads = step(state, x, 1.0 / (i + 1))
            deleted.append([a.is_deleted() for a in jtu.tree_leaves(old)
                            if isinstance(a, jax.Array)] + [x.is_deleted()])
            kinds.append(kind_list(state[1]))
    params, opt_state, count = state
    inner = opt_state.inner_state if offload else opt_state
    return {"bits": hex_bits((params, inner, count, grads)), "deleted": deleted,
            "kinds": kinds, "compiles": len(compiled),
            "count": [str(count.dtype), jax.typeof(count).weak_type]}


DONATIONS = {"argnums": {"donate_argnums": 0}, "argnames": {"donate_argnames": "state"}, "none": {}}


def donation_child() -> dict[str, Any]:
    """Plain `jax.jit` without offload, and `eqx_offload.jit` with it, per donation."""
    return {name: {"plain": _run(jax.jit, False, options),
                   "ported": _run(eqx_offload.jit, True, options)}
            for name, options in DONATIONS.items()}


def test_donating_a_host_resident_state() -> None:
    """In a fresh process (a wrong alias aborts it): bitwise plain jax.jit, inputs deleted
    where it deletes them, one compile, moments on the host, the int counter an int32 array."""
    results = call_isolated(donation_child)
    for name, runs in results.items():
        plain, ported = runs["plain"], runs["ported"]
        assert plain["bits"] == ported["bits"], name
        assert plain["deleted"] == ported["deleted"], name
        assert any(any(d) for d in plain["deleted"]) == (name != "none")
        assert plain["compiles"] == ported["compiles"] == 1, name
        assert ported["count"] == plain["count"] == ["int32", True]
        for kinds in ported["kinds"]:
            assert kinds == ["device"] + ["pinned_host"] * 4, kinds


def test_as_a_decorator_and_a_method() -> None:
    class Model:
        def __init__(self) -> None:
            self.w = jnp.arange(3.0)

        @eqx_offload.jit(static_argnums=0)
        def apply(self, x: jax.Array, k: int) -> jax.Array:
            return self.w * x + k

    # (`self` static: jax.jit's way for methods of hashable objects)
    assert_tree_equal(Model().apply(jnp.ones(3), 2), jnp.arange(3.0) + 2)


def _inject_run(jit: Any, port: bool) -> dict[str, Any]:
    """5 steps of `inject_hyperparams(adam)`, `b2` set to a new Python float before
    every step but the first, as optax's docstring sets a hyperparameter."""
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b2=0.999)
    if port:
        opt = eqx_offload.offloaded(opt)
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)}
    state = opt.init(params)

    def step(params: Any, state: Any, x: jax.Array) -> Any:
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jit(step)
    compiles, caught = [], []
    for i in range(5):
        if i:
            state.hyperparams["b2"] = 0.95 - 0.01 * i
        with count_compiles("step") as compiled, warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            params, state = step(params, state, jnp.full((2, 3), 0.1 * (i + 1)))
        compiles.append(len(compiled))
        caught += [str(m.message) for m in w]
    inner = state.inner_state if port else state
    return {"bits": hex_bits((params, inner)), "compiles": compiles, "warnings": caught,
            "kinds": kind_list(inner)}


def test_inject_hyperparams_python_float_between_steps() -> None:
    """jax.jit (and eqx_offload.jit) compile once more when `b2` becomes a Python float, then
    never again; filter_jit compiles at every new value, and says so once."""
    plain = _inject_run(jax.jit, False)
    ported = _inject_run(eqx_offload.jit, True)
    filtered = _inject_run(eqx_offload.filter_jit, True)
    assert plain["compiles"] == ported["compiles"] == [1, 1, 0, 0, 0]
    assert filtered["compiles"] == [1, 1, 1, 1, 1]
    assert plain["bits"] == ported["bits"] == filtered["bits"]
    assert plain["warnings"] == ported["warnings"] == []
    assert len(filtered["warnings"]) == 1
    assert "leaf .inner_state.hyperparams['b2'] is a Python float" in filtered["warnings"][0]
    assert ported["kinds"].count("pinned_host") == 4  # mu and nu of w and b

"""The default strategy (`group_bytes="auto"`): which update it compiles, and that it
never falls back to the whole state except for an update that cannot stream."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload
from eqx_offload._core.compat import scopes
from eqx_offload._optim import strategies


def _blocks() -> Any:
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(16, 16, key=k))(
        jax.random.split(jax.random.key(0), 4))


def _loss(model: Any, x: jax.Array) -> jax.Array:
    out = eqx_offload.scan_layers(model, x, lambda layer, h: jnp.tanh(layer(h)))
    return jnp.sum(out.astype(jnp.float32) ** 2)


def _modes(fun: Any, *args: Any) -> frozenset[str]:
    """The update modes the traced program holds (the scopes `filter_jit` reads)."""
    return scopes(jax.make_jaxpr(fun)(*args).jaxpr)


def _master_step(offload: Any) -> tuple[Any, Any, Any]:
    mw = eqx_offload.master_weights(optax.adamw(1e-3), offload=offload)
    model, state = mw.init(eqx_offload.to_host(_blocks()))

    def step(model: Any, state: Any) -> Any:
        x = jnp.ones(16, jnp.bfloat16)
        return mw.update(eqx.filter_grad(_loss)(model, x), state, model)
    return step, model, state


def _host_params_step(offload: Any) -> tuple[Any, Any, Any]:
    hp = eqx_offload.host_weights_optimizer(optax.adamw(1e-3), offload=offload)
    model = eqx_offload.to_host(_blocks())

    def step(model: Any, state: Any) -> Any:
        return hp.update(eqx.filter_grad(_loss)(model, jnp.ones(16)), state, model)
    return step, model, hp.init(model)


@pytest.mark.parametrize("make", [_master_step, _host_params_step],
                         ids=["master_weights", "host_weights_optimizer"])
def test_weights_in_host_memory_keep_the_streamed_branch(make: Any) -> None:
    """Gradients in host memory (of weights kept there): both branches return the same
    types, so the program keeps the accelerator's streamed update beside the CPU's
    whole-state one (in `platform_dependent`), and the result is bitwise the whole-state
    update's on the CPU, every leaf where `group_bytes=None` puts it."""
    step, model, state = make(eqx_offload.offloaded)
    assert {"streamed", "whole"} <= _modes(step, model, state)  # (and scan_layers')
    step_whole, _, _ = make(lambda t: eqx_offload.offloaded(t, group_bytes=None))
    assert "streamed" not in _modes(step_whole, model, state)
    got = eqx_offload.filter_jit(step)(model, state)
    want = eqx_offload.filter_jit(step_whole)(model, state)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.sharding.memory_kind == w.sharding.memory_kind
        assert g.dtype == w.dtype and bool(jnp.all(g == w))


def _platform_choices(jaxpr: Any) -> int:
    """How many `jax.lax.platform_dependent` choices a traced program holds."""
    return str(jaxpr).count("platform_index")


@pytest.mark.parametrize("platforms, modes", [
    ("call", {"whole"}),  # a call with arrays on the CPU: their devices' platform
    (("cpu",), {"whole"}),
    (("cuda",), {"streamed"}),
    (("tpu",), {"streamed"}),
    (("rocm", "cuda"), {"streamed"}),
    (("cpu", "cuda"), {"whole", "streamed"}),  # both platforms: the program chooses
])
def test_filter_jit_traces_the_update_of_the_platform_it_lowers_for(
        platforms: Any, modes: set[str]) -> None:
    """Under `eqx_offload.filter_jit` the default's branch is chosen before tracing,
    from the platforms the step is lowered for: the CPU alone traces the whole-state
    update (the fence after the gradients too: no `platform_dependent` is left), an
    accelerator the streamed one; for both, the program holds both."""
    params = {"w": jnp.ones((8, 8)), "b": jnp.ones(8)}
    opt = eqx_offload.offloaded(optax.adamw(1e-3))
    args = (params, opt.init(params), params)
    step = eqx_offload.filter_jit(opt.update)
    lowered = step.lower(*args) if platforms == "call" else step.lower_for(platforms, args, {})
    assert scopes(lowered.jaxpr.jaxpr) == modes
    assert (_platform_choices(lowered.jaxpr) > 0) == (len(modes) > 1)


def test_a_trace_for_platforms_unknown_holds_both_updates() -> None:
    """Under `jax.jit` (or `eqx.filter_jit`) the platform is not known while tracing:
    the program holds both updates and JAX lowers the one for its platform."""
    params = {"w": jnp.ones((8, 8)), "b": jnp.ones(8)}
    opt = eqx_offload.offloaded(optax.adamw(1e-3))
    jaxpr = jax.make_jaxpr(opt.update)(params, opt.init(params), params)
    assert scopes(jaxpr.jaxpr) == {"whole", "streamed"}
    assert eqx.filter_jit(lambda *a: _modes(opt.update, *a))(
        params, opt.init(params), params) == {"whole", "streamed"}


def test_an_update_that_cannot_stream_updates_the_whole_state() -> None:
    """`apply_if_finite` couples all of its state: `group_bytes=N` refuses it with a
    `CompositionError`, and the default compiles the whole-state update alone (the
    documented mode of such an update)."""
    params = {"w": jnp.ones((8, 8)), "b": jnp.ones(8)}
    inner = optax.apply_if_finite(optax.adam(1e-3), 3)
    default = eqx_offload.offloaded(inner)
    assert _modes(default.update, params, default.init(params), params) == {"whole"}
    streamed = eqx_offload.offloaded(inner, group_bytes=0)
    with pytest.raises(eqx_offload.errors.CompositionError, match="cannot be streamed"):
        jax.jit(streamed.update)(params, streamed.init(params), params)


@pytest.mark.parametrize("jit", ["jax.jit", "lower_for"])
def test_any_other_error_of_the_streamed_branch_comes_through(monkeypatch, jit: str) -> None:
    """An error of the streamed branch that is not `NotStreamable` is raised, not
    answered with the whole-state update: in the program for both platforms, and in
    the one for an accelerator alone."""
    def broken(*args: Any) -> Any:
        raise TypeError("a bug in the streamed update")

    monkeypatch.setattr(strategies, "streamed", broken)
    params = {"w": jnp.ones((8, 8))}
    opt = eqx_offload.offloaded(optax.adam(1e-3))
    args = (params, opt.init(params), params)
    with pytest.raises(TypeError, match="a bug in the streamed update"):
        if jit == "jax.jit":
            jax.jit(opt.update)(*args)
        else:
            eqx_offload.filter_jit(opt.update).lower_for(("cuda",), args, {})


@pytest.mark.parametrize("group_bytes", ["auto", 0])
def test_a_state_leaf_set_to_a_constant_stays_an_array(group_bytes: Any) -> None:
    """`optimistic_gradient_descent` sets `is_initial_step` to a constant: the streamed
    update returns it as the array `inner.update` returns, not as a Python value (which
    `filter_jit` would make static), and the state is bitwise plain optax's."""
    params = {"w": jnp.arange(16.0).reshape(4, 4) / 9, "b": jnp.ones(4)}
    inner = optax.optimistic_gradient_descent(1e-2)
    opt = eqx_offload.offloaded(inner, group_bytes=group_bytes)
    updates, state = eqx_offload.filter_jit(opt.update)(params, opt.init(params), params)
    want_updates, want_state = jax.jit(inner.update)(params, inner.init(params), params)
    got = eqx_offload.to_device(state.inner_state)
    assert jax.tree.structure(got) == jax.tree.structure(want_state)
    for g, w in zip(jax.tree.leaves((updates, got)), jax.tree.leaves((want_updates, want_state)),
                    strict=True):
        assert isinstance(g, jax.Array) and g.dtype == w.dtype and bool(jnp.all(g == w))

"""`offloaded` (`_optim/offloaded.py`) and its state (`_optim/state.py`): its options, where it composes
with the optax combinators without computing on host values, and reading its state the
optax ways. (Bitwise equality with the unwrapped optimizer: test_equivalence.py.)"""

from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import optax.contrib
import pytest
from helpers import (assert_multi_steps_updates, assert_placed, assert_tree_equal, make_grads,
                     make_params, walk_eqns)
from helpers import COMPOSITIONS, scale_by_arg
from jax.extend.core import Literal
from jaxtyping import TypeCheckError

import eqx_offload
from eqx_offload import OffloadedState
from eqx_offload._optim.options import normalise


def _compose(name: str) -> optax.GradientTransformationExtraArgs:
    return optax.with_extra_args_support(COMPOSITIONS[name](eqx_offload.offloaded))


def _host_operand_eqns(jaxpr: Any, allowed: set[str]) -> list[str]:
    """The primitives, at any depth and not in `allowed`, with a host-memory operand."""
    def on_host(eqn: Any) -> bool:
        return any(getattr(v.aval, "memory_space", None) == jax.memory.Space.Host
                   for v in (*eqn.invars, *eqn.outvars) if not isinstance(v, Literal))

    return [e.primitive.name for e in walk_eqns(jaxpr)
            if on_host(e) and e.primitive.name not in allowed]


# Transfers, call wrappers and the streamed update's barriers: they pass values unchanged.
TRANSFERS_AND_CALLS = {"device_put", "jit", "pjit", "closed_call", "optimization_barrier",
                       "custom_jvp_call"}  # (compat.optimization_barrier on JAX 0.10)
NO_HOST_TOUCH = sorted(n for n in COMPOSITIONS if not n.startswith(("apply_if_finite(", "MultiSteps(")))


@pytest.mark.parametrize("name", NO_HOST_TOUCH)
def test_recommended_order_no_compute_on_host(name: str) -> None:
    """In the jitted update host values flow only into transfers, calls and `cond`s (the
    default's choice of platform, `offloaded(MultiSteps)`'s applying branch)."""
    opt, params = _compose(name), make_params()
    jaxpr = jax.make_jaxpr(jax.jit(opt.update))(make_grads(params, 0), opt.init(params), params)
    assert jax.memory.Space.Host in [getattr(v.aval, "memory_space", None) for v in jaxpr.jaxpr.invars]
    allowed = TRANSFERS_AND_CALLS | {"cond"}
    assert _host_operand_eqns(jaxpr.jaxpr, allowed) == []


def test_apply_if_finite_around_offloaded_only_routes_state() -> None:
    """`apply_if_finite(offloaded(x))` hands the host state through a `cond`, no more."""
    opt, params = _compose("apply_if_finite(offloaded(adamw))"), make_params()
    jaxpr = jax.make_jaxpr(opt.update)(make_grads(params, 0), opt.init(params), params)
    assert set(_host_operand_eqns(jaxpr.jaxpr, TRANSFERS_AND_CALLS)) == {"cond"}


def test_inner_order_rejected_by_filter_jit() -> None:
    """`MultiSteps(offloaded(x))` computes on the host state (pinned by the canary
    tests/upstream/test_upstream_multisteps.py): `filter_jit` names the order that works."""
    opt, params = _compose("MultiSteps(offloaded(adamw))"), make_params()
    step = eqx_offload.filter_jit(lambda g, s, p: opt.update(g, s, p))
    with pytest.raises(eqx_offload.errors.CompositionError, match=r"offloaded\(optax.MultiSteps"):
        step(make_grads(params, 0), opt.init(params), params)


def test_prng_key_no_false_warning_under_jit() -> None:
    """A host-resident typed key reads as device memory inside `jit`: no warning."""
    plain = optax.noisy_sgd(0.1, key=jax.random.key(0))
    opt = eqx_offload.offloaded(optax.noisy_sgd(0.1, key=jax.random.key(0)), where=True)
    params = make_params()
    state, plain_state = opt.init(params), jax.device_put(plain.init(params), jax.devices()[0])
    for step in range(2):
        updates, state = jax.jit(opt.update)(make_grads(params, step), state)  # warnings: errors
        plain_updates, plain_state = jax.jit(plain.update)(make_grads(params, step), plain_state)
        assert_tree_equal((plain_updates, plain_state), (updates, state.inner_state))
        assert_placed(state, True)


@pytest.mark.parametrize("every_k", [1, 2])
def test_multi_steps_passes_extra_args(every_k: int) -> None:
    """`offloaded(MultiSteps(x))` hands keyword arguments to `x` (a plain
    `with_extra_args_support` around `.gradient_transformation()` drops them)."""
    params = {"w": jnp.arange(3.0)}
    inner = optax.MultiSteps(scale_by_arg(), every_k)
    opt = eqx_offload.offloaded(optax.MultiSteps(scale_by_arg(), every_k))
    state, ref_state = opt.init(params), inner.init(params)
    for _ in range(3):
        updates, state = opt.update(params, state, params, factor=5.0)
        ref_updates, ref_state = inner.update(params, ref_state, params, factor=5.0)
        assert_multi_steps_updates(ref_updates, updates)
    assert_tree_equal(state.inner_state, ref_state)
    assert state.inner_state.acc_grads["w"].sharding.memory_kind == "device"  # by design


@pytest.mark.parametrize("kwargs, match", [
        ({"compute": "gpu"}, "compute must be 'device' \\(default\\) or 'host'"),
        ({"group_bytes": -1}, ">= 0"),
        ({"group_bytes": 1.5}, "must be an int"),
        ({"group_bytes": True}, "must be an int"),
        ({"group_bytes": 0, "compute": "host"}, "exclude each other"),
        ({"lookahead": -1}, "lookahead must be an int >= 0"),
        ({"lookahead": 1.0}, "lookahead must be an int >= 0"),
        ({"host_dtype": "int32"}, "host_dtype must be a floating dtype"),
        ({"host_dtype": "not a dtype"}, "host_dtype must be a floating dtype"),
        ({"host_dtype": "bfloat16", "compute": "host"}, "nothing to narrow"),
])
def test_bad_options(kwargs: dict[str, Any], match: str) -> None:
    """Each bad option is an `OptionError` (a ValueError or TypeError) naming it."""
    options = {"where": True, "memory_kind": "pinned_host", "group_bytes": None,
               "lookahead": 1, "compute": "device", "host_dtype": None, **kwargs}
    with pytest.raises(eqx_offload.errors.OptionError, match=match) as info:
        normalise(**options)
    assert isinstance(info.value, (ValueError, TypeError))
    # Under the suite's runtime type checks, jaxtyping refuses a wrong type first.
    with pytest.raises((eqx_offload.errors.OptionError, TypeCheckError)):
        eqx_offload.offloaded(optax.adam(1e-3), **kwargs)


# ------------------------------------------------------------------------ reading the state


def test_hyperparams_read_through_the_state() -> None:
    """`state.hyperparams` and `optax.tree.get` read through; `optax.tree.set` on the
    inner state reaches the next update."""
    params = make_params()
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    opt = eqx_offload.offloaded(optax.inject_hyperparams(optax.adam)(learning_rate=0.1))
    state, ref_state = opt.init(params), inner.init(params)
    assert_tree_equal(state.hyperparams, ref_state.hyperparams)
    assert_tree_equal(optax.tree.get(state, "learning_rate"), optax.tree.get(ref_state, "learning_rate"))
    assert_tree_equal(optax.tree_utils.tree_get(state, "learning_rate"), jnp.asarray(0.1))
    state = OffloadedState(optax.tree.set(state.inner_state, learning_rate=0.5))
    ref_state = optax.tree.set(ref_state, learning_rate=0.5)
    updates, state = opt.update(make_grads(params, 0), state, params)
    ref_updates, ref_state = inner.update(make_grads(params, 0), ref_state, params)
    assert_tree_equal(updates, ref_updates)
    assert float(state.hyperparams["learning_rate"]) == 0.5


def test_reading_brings_leaves_to_the_device_and_keeps_the_host_copy() -> None:
    """An attribute read is a device copy; the host copy stays; no private name."""
    state = eqx_offload.offloaded(optax.adam(0.1)).init(make_params())
    mu = state.inner_state[0].mu
    read = OffloadedState(state.inner_state[0]).mu
    assert {x.sharding.memory_kind for x in jtu.tree_leaves(read)} == {"device"}
    assert_placed(state)
    assert_tree_equal(read, mu)
    with pytest.raises(AttributeError, match="nor has its inner_state"):
        state.no_such_field  # noqa: B018
    assert not hasattr(state, "__jax_array__")


@pytest.mark.parametrize("every_k", [1, 2, 3])
def test_multi_steps_has_updated(every_k: int) -> None:
    """`optax.MultiSteps` (no GradientTransformation) is taken through its
    `.gradient_transformation()`; `has_updated` reads the state, eagerly and under `filter_jit`."""
    params = make_params()
    inner = optax.MultiSteps(optax.adam(0.1), every_k)
    opt = eqx_offload.offloaded(inner)
    state, ref_state = opt.init(params), inner.init(params)
    assert type(state.inner_state).__name__ == "MultiStepsState"
    assert_placed(state)
    for i in range(4):
        _, state = opt.update(make_grads(params, i), state, params)
        _, ref_state = inner.update(make_grads(params, i), ref_state, params)
        assert bool(inner.has_updated(state)) == bool(inner.has_updated(ref_state))
    update = eqx_offload.filter_jit(lambda g, s, p: (opt.update(g, s, p)[1], inner.has_updated(s)))
    _, flag = update(make_grads(params, 0), state, params)
    assert bool(flag) == bool(inner.has_updated(ref_state))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_schedule_free_eval_params(mode: str) -> None:
    """`schedule_free_eval_params` reads an offloaded state bitwise as the plain one."""
    params = make_params()
    inner = optax.contrib.schedule_free_adamw(0.1)
    opt = eqx_offload.offloaded(optax.contrib.schedule_free_adamw(0.1))
    state, ref_state = opt.init(params), inner.init(params)
    for i in range(3):
        updates, state = opt.update(make_grads(params, i), state, params)
        _, ref_state = inner.update(make_grads(params, i), ref_state, params)
        params = optax.apply_updates(params, updates)
    assert_placed(state)
    eval_params = ref_eval_params = optax.contrib.schedule_free_eval_params
    if mode == "jit":  # compiled against compiled (eager and jit differ in bits)
        eval_params, ref_eval_params = eqx_offload.filter_jit(eval_params), jax.jit(ref_eval_params)
    assert_tree_equal(eval_params(state, params), ref_eval_params(ref_state, params))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_hyperparams_written_in_place(mode: str) -> None:
    """`opt_state.hyperparams["learning_rate"] = lr` (as optax documents) reaches the state."""
    params = make_params()
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    opt = eqx_offload.offloaded(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    update = opt.update if mode == "eager" else eqx_offload.filter_jit(opt.update)
    ref_update = inner.update if mode == "eager" else jax.jit(inner.update)
    state, ref_state = opt.init(params), inner.init(params)
    state.hyperparams["learning_rate"] = jnp.asarray(0.5)
    ref_state.hyperparams["learning_rate"] = jnp.asarray(0.5)
    updates, state = update(make_grads(params, 0), state, params)
    ref_updates, _ = ref_update(make_grads(params, 0), ref_state, params)
    assert_tree_equal(updates, ref_updates)
    assert float(state.hyperparams["learning_rate"]) == 0.5

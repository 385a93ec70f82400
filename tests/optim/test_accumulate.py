"""`offloaded(optax.MultiSteps(...))`: the same training as the plain `MultiSteps`, bit for
bit, with the inner optimizer's state moved only on the mini-step that applies it."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest

import eqx_offload
from eqx_offload._core.compat import scopes
from helpers import (assert_multi_steps_updates, assert_tree_equal, donated_step, gpu_plan_marks,
                     walk_eqns)


def _params() -> dict[str, jax.Array]:
    return {"w": jnp.arange(12.0).reshape(3, 4) / 7, "b": jnp.linspace(-1.0, 1.0, 4),
            "s": jnp.asarray(0.5)}


def _grads(params: Any, i: int) -> Any:
    grads = jax.tree.map(lambda p: jnp.sin(p * (i + 1)) - 0.3, params)
    if i == 4:  # a NaN mini-step: skipped with `skip_not_finite`
        grads = {**grads, "b": grads["b"].at[0].set(jnp.nan)}
    return grads


def _multi(schedule: str, skip: bool) -> optax.MultiSteps:
    every_k = 3 if schedule == "int" else (lambda step: jnp.where(step < 1, 2, 3))
    return optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=every_k,
                            should_skip_update_fn=optax.skip_not_finite if skip else None)


def _assert_placement(state: Any, accumulator: str) -> None:
    """The inner optimizer's arrays (but 0-d counters) in pinned_host, the accumulator
    where chosen, MultiSteps' counters on the device."""
    multi = state.inner_state
    for x in jax.tree.leaves(multi.inner_opt_state):
        assert x.sharding.memory_kind == ("pinned_host" if x.ndim else "device")
    for x in jax.tree.leaves(multi.acc_grads):
        want = "pinned_host" if accumulator == "host" and x.ndim else "device"
        assert x.sharding.memory_kind == want
    assert multi.mini_step.sharding.memory_kind == "device"


# One matrix: the accumulator on the device in every combination, in host memory under
# `jit` and eagerly with an int schedule (each eager host-compute call compiles).
@pytest.mark.parametrize("accumulator,mode,schedule,skip", [
    (accumulator, mode, schedule, skip)
    for accumulator in ("device", "host") for mode in ("eager", "jit")
    for schedule in ("int", "callable") for skip in (False, True)
    if not (accumulator == "host" and mode == "eager" and schedule == "callable")
])
def test_bitwise_multi_steps(accumulator, mode, schedule, skip):
    plain, multi = _multi(schedule, skip), _multi(schedule, skip)
    opt = eqx_offload.offloaded(multi, accumulator=accumulator)
    plain_update, update = plain.update, opt.update
    if mode == "jit":
        plain_update, update = jax.jit(plain_update), eqx_offload.filter_jit(update)
    params = plain_params = _params()
    plain_state, state = plain.init(params), opt.init(params)
    _assert_placement(state, accumulator)
    applied, negative_zeros = [], 0
    for i in range(8):
        grads = _grads(params, i) if skip else _grads(params, i + (i >= 4))
        gradient_step = int(plain_state.gradient_step)
        plain_updates, plain_state = plain_update(grads, plain_state, plain_params)
        updates, state = update(grads, state, params)
        # The whole state, leaf for leaf, and its fields as users read them.
        assert_tree_equal(
            (plain_state, plain_state.mini_step, plain_state.gradient_step, plain_state.acc_grads),
            (state.inner_state, state.mini_step, state.gradient_step, state.acc_grads))
        _assert_placement(state, accumulator)
        applied.append(int(plain_state.gradient_step) > gradient_step)
        assert_multi_steps_updates(plain_updates, updates, applied[-1])
        if not applied[-1]:
            negative_zeros += sum(int(np.signbit(u).sum()) for u in jax.tree.leaves(plain_updates))
        assert bool(plain.has_updated(state)) == bool(plain.has_updated(plain_state))
        plain_params = optax.apply_updates(plain_params, plain_updates)
        params = optax.apply_updates(params, updates)
        assert_tree_equal(plain_params, params)  # (no parameter is -0.0)
    assert sum(applied) >= 2  # the test applies the inner update more than once
    assert negative_zeros  # MultiSteps' -0.0, told from +0.0 by `assert_multi_steps_updates`


def test_nan_mini_step_without_skip():
    """Without `should_skip_update_fn` a NaN gradient makes MultiSteps' updates NaN; the
    offloaded ones are +0.0 until the applying mini-step, NaN in both; states bitwise."""
    plain, opt = _multi("int", False), eqx_offload.offloaded(_multi("int", False))
    params = _params()
    plain_state, state = plain.init(params), opt.init(params)
    for i in (3, 4, 5):  # mini-steps 0, 1, 2: the NaN one (i == 4) does not apply
        grads = _grads(params, i)
        plain_updates, plain_state = jax.jit(plain.update)(grads, plain_state, params)
        updates, state = eqx_offload.filter_jit(opt.update)(grads, state, params)
        assert_tree_equal(plain_state, state.inner_state)
        if i == 4:
            assert np.isnan(plain_updates["b"]).any()
            assert_multi_steps_updates(plain_updates, updates, applied=False)
    assert int(state.gradient_step) == 1 and np.isnan(updates["b"]).any()
    assert_tree_equal(plain_updates, updates)


def test_gradient_transformation_form_and_extra_args():
    """`MultiSteps(...).gradient_transformation()` is recognised; extra arguments reach the
    inner optimizer (`reduce_on_plateau` reads `value`)."""
    inner = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=1))
    plain = optax.MultiSteps(inner, every_k_schedule=2)
    opt = eqx_offload.offloaded(optax.MultiSteps(inner, 2).gradient_transformation())
    params = _params()
    plain_state, state = plain.init(params), opt.init(params)
    assert type(state.inner_state).__name__ == "MultiStepsState"
    value = jnp.asarray(1.0)
    for i in range(4):
        grads = _grads(params, i)
        _, plain_state = jax.jit(plain.update)(grads, plain_state, params, value=value)
        _, state = eqx_offload.filter_jit(opt.update)(grads, state, params, value=value)
        assert_tree_equal(plain_state, state.inner_state)


def test_state_crosses_only_in_the_applying_branch():
    """Every copy of the inner state (and computation on it) is inside a `cond` branch."""
    opt = eqx_offload.offloaded(_multi("int", True))
    params = _params()
    jaxpr = jax.make_jaxpr(opt.update)(_grads(params, 0), opt.init(params), params).jaxpr
    host = jax.memory.Space.Host

    def touches_host(eqn: Any) -> bool:
        return any(getattr(getattr(v, "aval", None), "memory_space", None) == host
                   for v in (*eqn.invars, *eqn.outvars))

    outer = [e.primitive.name for e in jaxpr.eqns if touches_host(e)]
    assert outer == ["cond"]  # the skip cond, whose branches hold the applying cond
    (skip_cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    do_update = skip_cond.params["branches"][0].jaxpr  # (false, true): not skipped
    inner = [e.primitive.name for e in do_update.eqns if touches_host(e)]
    assert inner == ["cond"]  # the applying cond: the state moves inside it only
    (apply_cond,) = [e for e in do_update.eqns if touches_host(e)]
    keep, apply = (b.jaxpr for b in apply_cond.params["branches"])
    assert not any(e.primitive.name == "device_put" for e in walk_eqns(keep))
    assert sum(e.primitive.name == "device_put" for e in walk_eqns(apply)) >= 2  # down, up


def test_donation():
    model = eqx.nn.MLP(4, 1, width_size=8, depth=1, key=jax.random.key(0))
    opt = eqx_offload.offloaded(optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2))
    step, (model, state, x) = donated_step(opt, model, jnp.ones((8, 4)))
    for _ in range(3):
        old = jax.tree.leaves((eqx.filter(model, eqx.is_array), state))
        model, state = step(model, state, x)
        assert all(leaf.is_deleted() for leaf in old if leaf.ndim)
        _assert_placement(state, "device")
    assert int(state.gradient_step) == 1


def test_host_dtype_narrows_the_inner_state():
    opt = eqx_offload.offloaded(optax.MultiSteps(optax.adam(1e-2), 2), host_dtype=jnp.bfloat16)
    params = _params()
    state = opt.init(params)
    for i in range(2):
        updates, state = eqx_offload.filter_jit(opt.update)(_grads(params, i), state, params)
    mu = state.inner_state.inner_opt_state[0].mu["w"]
    assert mu.dtype == jnp.bfloat16 and mu.sharding.memory_kind == "pinned_host"
    assert jax.tree.leaves(updates)[0].dtype == jnp.float32
    assert all(bool(jnp.isfinite(u).all()) and bool(jnp.any(u != 0))
               for u in jax.tree.leaves(updates) if u.ndim)


def test_host_dtype_with_the_accumulator_in_host_memory():
    """`host_dtype=jnp.bfloat16` with `accumulator="host"` (refused by `lax.cond` before:
    the new sum came out in float32 where the stored one is bf16): the sum stays bf16 in
    host memory (on the device, `accumulator="device"`, it is float32), and the updates
    are those of the float32 sum to bf16's precision."""
    params = _params()
    results = {}
    for accumulator, dtype, kind in (("host", jnp.bfloat16, "pinned_host"),
                                     ("device", jnp.float32, "device")):
        opt = eqx_offload.offloaded(optax.MultiSteps(optax.adam(1e-2), 2),
                                    host_dtype=jnp.bfloat16, accumulator=accumulator)
        state = opt.init(params)
        found = []
        for i in range(4):
            updates, state = eqx_offload.filter_jit(opt.update)(_grads(params, i), state, params)
            found.append(updates)
        acc = state.inner_state.acc_grads["w"]
        assert acc.dtype == dtype and acc.sharding.memory_kind == kind
        results[accumulator] = found
    for host, device in zip(jax.tree.leaves(results["host"]), jax.tree.leaves(results["device"])):
        np.testing.assert_allclose(host, device, rtol=2e-2, atol=1e-6)
    assert any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(results["host"]))


def test_other_modes_keep_the_whole_wrapper_offloaded():
    """`compute="host"` and `group_bytes=N` offload the whole `MultiSteps`, accumulator too."""
    for options in ({"compute": "host"}, {"group_bytes": 1 << 20}):
        opt = eqx_offload.offloaded(optax.MultiSteps(optax.adam(1e-2), 2), **options)
        state = opt.init(_params())
        assert state.inner_state.acc_grads["w"].sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("inner,options", [
    (optax.adam(1e-2), {"accumulator": "host"}),  # nothing to accumulate
    (optax.MultiSteps(optax.adam(1e-2), 2), {"accumulator": "host", "compute": "host"}),
    (optax.MultiSteps(optax.adam(1e-2), 2), {"accumulator": "host", "group_bytes": 1 << 20}),
    (optax.MultiSteps(optax.adam(1e-2), 2), {"accumulator": "disk"}),
])
def test_accumulator_option_errors(inner, options):
    # (`"disk"`: the runtime type check at test time, an `OptionError` without it.)
    with pytest.raises((eqx_offload.errors.OptionError, jaxtyping.TypeCheckError), match="accumulator"):
        eqx_offload.offloaded(inner, **options)


# ------------------------------------------------------------------------------ GPU plan


def _plan(optimizer: Any, k: int = 4, scan: bool = False) -> tuple[Any, tuple[Any, ...]]:
    """The GPU plan of a donated step of a small MLP (one mini-step of `optimizer`, or with
    `scan` `k` micro-batches scanned and one update), and the step's arguments."""
    model = eqx.nn.MLP(256, 256, 256, 2, key=jax.random.key(0))
    step, args = donated_step(optimizer, model, jnp.ones((32, 256)))
    if scan:
        def grads_of(model: Any, x: Any) -> Any:
            return eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)

        @eqx_offload.filter_jit(donate="all")
        def step(model, state, x):
            zero = jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_array))
            grads, _ = jax.lax.scan(
                lambda acc, xi: (jax.tree.map(jnp.add, acc, grads_of(model, xi)), None), zero, x)
            grads = jax.tree.map(lambda g: g / k, grads)
            updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state

        args = (model, args[1], jnp.ones((k, 32, 256)))
    return eqx_offload.planner.gpu_plan(step, *args, target="h100"), args


def _host_bytes(state: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state) if x.sharding.memory_kind == "pinned_host")


def _plan_marks(test: Any) -> Any:
    for mark in gpu_plan_marks():
        test = mark(test)
    return test


def _multi_steps(**options: Any) -> Any:
    return eqx_offload.offloaded(optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=4), **options)


@pytest.mark.parametrize("idiom", ["multi_steps", "scan"])
@_plan_marks
def test_plan_state_crosses_once_per_optimizer_step(idiom):
    scan = idiom == "scan"
    plan, args = _plan(eqx_offload.offloaded(optax.adamw(1e-3)) if scan else _multi_steps(),
                       scan=scan)
    state_bytes = _host_bytes(args[1])
    assert plan.copies
    runs = 1 if scan else 4  # steps of the program per optimizer step
    for direction in ("to_device", "to_host"):
        copies = plan.copies_to(direction)
        if idiom == "multi_steps":  # every copy in the applying branch: once per k
            assert all(c.conditional for c in copies)
        every_time = sum(c.nbytes * c.count for c in copies if not c.conditional)
        once = sum(c.nbytes * c.count for c in copies if c.conditional)
        assert every_time * runs + once <= 1.1 * state_bytes, direction


@_plan_marks
def test_plan_host_accumulator_sends_gradients_once():
    """`accumulator="host"`: each mini-step sends its gradients (and two scalars) to host,
    nothing back; the applying branch brings the inner state and the sum in, the state out."""
    plan, (model, state, _) = _plan(_multi_steps(accumulator="host"))
    grad_bytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    inner_bytes = _host_bytes(state.inner_state.inner_opt_state)
    acc_bytes = _host_bytes(state.inner_state.acc_grads)
    assert acc_bytes == grad_bytes

    def moved(direction: str, conditional: bool) -> int:
        return sum(c.nbytes * c.count for c in plan.copies_to(direction)
                   if c.conditional == conditional)

    assert grad_bytes <= moved("to_host", False) <= grad_bytes + 8
    assert moved("to_device", False) == 0
    assert inner_bytes <= moved("to_device", True) - acc_bytes <= 1.1 * inner_bytes
    assert inner_bytes <= moved("to_host", True) <= 1.1 * inner_bytes


@_plan_marks
def test_plan_applying_branch_is_streamed():
    """For a GPU the applying branch streams the inner state: a lower device peak than the
    whole state at once (`group_bytes=None`), the same bytes each way."""
    plans = {g: _plan(_multi_steps(group_bytes=g))[0] for g in ("auto", None)}
    assert plans["auto"].device_peak_bytes < plans[None].device_peak_bytes
    for direction in ("to_device", "to_host"):
        assert plans["auto"].bytes_moved(direction) == plans[None].bytes_moved(direction)


@pytest.mark.parametrize("platforms, streamed, choices", [
    (("cpu",), False, False),  # the whole state alone: no streamed branch traced
    (("tpu",), True, False),  # the streamed branch alone
    (("cpu", "cuda"), True, True),  # both platforms: the program chooses
])
def test_applying_step_traces_the_branch_of_the_platforms_it_lowers_for(
        platforms: Any, streamed: bool, choices: bool) -> None:
    """The applying mini-step chooses its branch as the default update does
    (`strategies.by_platform`): before tracing where `filter_jit` knows the platforms,
    so neither branch is traced to be dropped; for several, both in the program."""
    params = _params()
    opt = eqx_offload.offloaded(optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2))
    args = (params, opt.init(params), params)
    lowered = eqx_offload.filter_jit(opt.update).lower_for(platforms, args, {})
    assert ("streamed" in scopes(lowered.jaxpr.jaxpr)) == streamed
    assert ("platform_index" in str(lowered.jaxpr)) == choices

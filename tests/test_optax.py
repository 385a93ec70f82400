"""`offloaded`: bitwise transparent for every optax optimizer and combinator, with the
offloaded state in host memory between steps and no compute on host-resident values."""

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import optax.contrib
import pytest
from helpers import assert_tree_equal, count_compiles
from jax.extend.core import jaxprs_in_params, Literal

import eqx_offload
from eqx_offload import OffloadedState


STEPS = 3

# ---------------------------------------------------------------------------------------
# Helpers


def _unwrap(tree: Any) -> Any:
    """The tree with every `OffloadedState(x)` replaced by `x` (its inner state)."""
    return jtu.tree_map(
        lambda x: _unwrap(x.inner_state) if isinstance(x, OffloadedState) else x,
        tree,
        is_leaf=lambda x: isinstance(x, OffloadedState),
    )


def _assert_placement(state: Any, where: Callable[[Any], bool] = eqx_offload.min_ndim(1)) -> None:
    """Every leaf inside an `OffloadedState` that `where` selects is in `pinned_host`;
    every other array leaf of the whole state is in device memory (as is the
    accumulator of `offloaded(MultiSteps(...))`, `acc_grads`)."""

    def visit(tree: Any, offloaded: bool) -> None:
        for path, leaf in jtu.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, OffloadedState)
        )[0]:
            if isinstance(leaf, OffloadedState):
                visit(leaf.inner_state, True)
            elif isinstance(leaf, jax.Array):
                grad = any(getattr(k, "name", None) == "grad" for k in path)  # line search's
                on_host = offloaded and where(leaf) and not grad and ".acc_grads" not in jtu.keystr(path)
                want = "pinned_host" if on_host else "device"
                assert leaf.sharding.memory_kind == want, (jtu.keystr(path), leaf.sharding)

    visit(state, False)


def _assert_updates_equal(name: str, expected: Any, got: Any) -> None:
    """Bitwise, but for `offloaded(MultiSteps(...))`: on a mini-step that does not apply,
    MultiSteps returns `0 * u` for the inner update `u` it discards (-0.0 where `u < 0`);
    `offloaded` does not compute `u` there (its state stays on host) and returns +0.0.
    Equal as numbers (docs/how-to/gradient-accumulation.md)."""
    if not name.startswith("offloaded(MultiSteps"):
        assert_tree_equal(expected, got)
        return
    assert jtu.tree_structure(expected) == jtu.tree_structure(got)
    for a, b in zip(jtu.tree_leaves(expected), jtu.tree_leaves(got)):
        assert a.dtype == b.dtype and np.array_equal(a, b), (a, b)


def _host_operand_eqns(jaxpr: Any, allowed: frozenset[str]) -> list[str]:
    """Every equation, at any depth, that reads or writes a host-memory-space value and
    whose primitive is not in `allowed`: `"name(in/out memory spaces)"`."""
    found = []
    for eqn in jaxpr.eqns:
        spaces = [
            getattr(v.aval, "memory_space", None)
            for v in (*eqn.invars, *eqn.outvars)
            if not isinstance(v, Literal)
        ]
        if jax.memory.Space.Host in spaces and eqn.primitive.name not in allowed:
            found.append(eqn.primitive.name)
        for sub in jaxprs_in_params(eqn.params):
            found.extend(_host_operand_eqns(sub, allowed))
    return found


# Transfers, the call wrappers that hand values through to a sub-jaxpr unchanged, and the
# barriers that order the streamed update's transfers (they pass values unchanged).
TRANSFERS_AND_CALLS = frozenset({"device_put", "jit", "pjit", "closed_call",
                                 "optimization_barrier"})


def _params(dtype: Any = jnp.float32) -> dict[str, jax.Array]:
    return {
        "w": jnp.arange(12, dtype=dtype).reshape(3, 4) / 7,
        "b": jnp.linspace(-1, 1, 4).astype(dtype),
        "s": jnp.asarray(0.5, dtype),  # a 0-d parameter: its state stays on the device
    }


def _mixed_params(complex_ok: bool, scalar_ok: bool) -> dict[str, jax.Array]:
    """float32 parameters, plus a complex64 one where the optimizer supports it, plus a
    0-d one where it supports that (sm3 does not, upstream)."""
    params = _params()
    if complex_ok:
        params["c"] = (jnp.arange(6.0) - 2.5j * jnp.arange(6.0)).astype(jnp.complex64).reshape(2, 3)
    if not scalar_ok:
        del params["s"]
    return params


def _grads(params: Any, step: int) -> Any:
    return jtu.tree_map(lambda x: x * (step + 1) + 0.5, params)


def _loss(params: Any) -> jax.Array:
    return sum(jnp.sum(jnp.abs(x) ** 2) for x in jtu.tree_leaves(params))


# ---------------------------------------------------------------------------------------
# Every optimizer: name -> (factory, extra update arguments, supports complex params)


def _no_extra(params: Any) -> dict[str, Any]:
    return {}


def _value(params: Any) -> dict[str, Any]:
    return {"value": _loss(params)}


def _lbfgs_extra(params: Any) -> dict[str, Any]:
    value, grad = jax.value_and_grad(_loss)(params)
    return {"value": value, "grad": grad, "value_fn": _loss}


def _optimistic_adam() -> optax.GradientTransformation:
    with warnings.catch_warnings():  # deprecated in favour of optimistic_adam_v2
        warnings.simplefilter("ignore", DeprecationWarning)
        return optax.optimistic_adam(LR)


LR = 0.1
# name -> (factory, extra `update` arguments, supports complex params). Of those that do
# not, all but prodigy reject complex params with an error (prodigy casts them to real,
# with a JAX DeprecationWarning: not supported).
OPTIMIZERS: dict[str, tuple[Callable[[], optax.GradientTransformation], Callable[[Any], dict], bool]] = {
    "adabelief": (lambda: optax.adabelief(LR), _no_extra, True),
    "adadelta": (lambda: optax.adadelta(LR), _no_extra, True),
    "adafactor": (lambda: optax.adafactor(LR), _no_extra, True),
    "adagrad": (lambda: optax.adagrad(LR), _no_extra, True),
    "adam": (lambda: optax.adam(LR), _no_extra, True),
    "adamax": (lambda: optax.adamax(LR), _no_extra, True),
    "adamaxw": (lambda: optax.adamaxw(LR), _no_extra, True),
    "adamw": (lambda: optax.adamw(LR), _no_extra, True),
    "adan": (lambda: optax.adan(LR), _no_extra, True),
    "amsgrad": (lambda: optax.amsgrad(LR), _no_extra, True),
    "fromage": (lambda: optax.fromage(LR), _no_extra, True),
    "lamb": (lambda: optax.lamb(LR), _no_extra, True),
    "lars": (lambda: optax.lars(LR), _no_extra, True),
    "lbfgs": (lambda: optax.lbfgs(LR), _lbfgs_extra, True),
    "lion": (lambda: optax.lion(LR), _no_extra, True),
    "nadam": (lambda: optax.nadam(LR), _no_extra, True),
    "nadamw": (lambda: optax.nadamw(LR), _no_extra, True),
    "noisy_sgd": (lambda: optax.noisy_sgd(LR, key=jax.random.key(0)), _no_extra, True),
    "novograd": (lambda: optax.novograd(LR), _no_extra, True),
    "optimistic_adam": (_optimistic_adam, _no_extra, True),
    "optimistic_adam_v2": (lambda: optax.optimistic_adam_v2(LR), _no_extra, True),
    "optimistic_gradient_descent": (lambda: optax.optimistic_gradient_descent(LR), _no_extra, True),
    "polyak_sgd": (lambda: optax.polyak_sgd(), _value, True),
    "radam": (lambda: optax.radam(LR), _no_extra, True),
    "rmsprop": (lambda: optax.rmsprop(LR, momentum=0.9), _no_extra, True),
    "rprop": (lambda: optax.rprop(LR), _no_extra, False),  # clips: no complex
    "sgd": (lambda: optax.sgd(LR, momentum=0.9), _no_extra, True),
    "sign_sgd": (lambda: optax.sign_sgd(LR), _no_extra, True),
    "signum": (lambda: optax.signum(LR), _no_extra, True),
    "sm3": (lambda: optax.sm3(LR), _no_extra, False),  # rejects complex
    "yogi": (lambda: optax.yogi(LR), _no_extra, True),
    # optax.contrib (not top-level aliases; the popular ones)
    "contrib.muon": (lambda: optax.contrib.muon(LR), _no_extra, True),
    "contrib.adopt": (lambda: optax.contrib.adopt(LR), _no_extra, False),  # clips
    "contrib.ademamix": (lambda: optax.contrib.ademamix(LR), _no_extra, True),
    "contrib.prodigy": (lambda: optax.contrib.prodigy(LR), _no_extra, False),
    "contrib.schedule_free_adamw": (lambda: optax.contrib.schedule_free_adamw(LR), _no_extra, True),
}


def _alias_names() -> set[str]:
    """Every optimizer alias optax defines in `optax._src.alias` (all are top level)."""
    from optax._src import alias

    names = set()
    for name, value in vars(alias).items():
        fn = value.func if isinstance(value, functools.partial) else value
        if not name.startswith("_") and inspect.isfunction(fn) and fn.__module__ == alias.__name__:
            names.add(name)
    return names


def test_every_optax_alias_is_covered():
    aliases = _alias_names()
    assert len(aliases) >= 27  # adam ... yogi: the walk really found them
    assert all(hasattr(optax, name) for name in aliases)
    missing = aliases - set(OPTIMIZERS)
    assert not missing, f"optax has optimizers this test does not cover: {sorted(missing)}"


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_transparent(name, mode):
    # float32 and (where supported) complex64 parameters in one tree, `STEPS` steps:
    # updates, state and parameters bitwise equal to the unwrapped optimizer's, and the
    # state in host memory (0-d leaves on the device) after every step.
    make, extra, complex_ok = OPTIMIZERS[name]
    plain, wrapped = make(), eqx_offload.offloaded(make())
    plain_update, wrapped_update = plain.update, wrapped.update
    params = _mixed_params(complex_ok, scalar_ok=name != "sm3")
    if mode == "jit":
        # `value_fn` (lbfgs) is a function: static.
        plain_update = jax.jit(plain.update, static_argnames="value_fn")
        wrapped_update = jax.jit(wrapped.update, static_argnames="value_fn")
        # Committed params: one compilation each (see test_jit's compile counts).
        params = jax.device_put(params, jax.devices()[0])
    plain_params = params
    plain_state, state = plain.init(params), wrapped.init(params)
    if mode == "jit":
        plain_state = jax.device_put(plain_state, jax.devices()[0])
    assert isinstance(state, OffloadedState)
    assert_tree_equal(plain_state, state.inner_state)
    _assert_placement(state)
    for step in range(STEPS):
        grads = _grads(params, step)
        plain_updates, plain_state = plain_update(
            grads, plain_state, plain_params, **extra(plain_params)
        )
        updates, state = wrapped_update(grads, state, params, **extra(params))
        assert_tree_equal(plain_updates, updates)
        assert_tree_equal(plain_state, state.inner_state)
        _assert_placement(state)
        plain_params = optax.apply_updates(plain_params, plain_updates)
        params = optax.apply_updates(params, updates)
    assert_tree_equal(plain_params, params)


@pytest.mark.parametrize(
    "name", sorted(n for n, (_, _, c) in OPTIMIZERS.items() if not c and n != "contrib.prodigy")
)
def test_complex_rejected_like_the_unwrapped_optimizer(name):
    # Where an optimizer rejects complex parameters, the offloaded one rejects them too,
    # with the same error (not a different one from the offload machinery).
    make, extra, _ = OPTIMIZERS[name]
    params = _params(jnp.complex64)

    def first_step(opt: optax.GradientTransformation) -> None:
        opt.update(_grads(params, 0), opt.init(params), params, **extra(params))

    with pytest.raises((ValueError, TypeError)) as plain_error:
        first_step(make())
    with pytest.raises(type(plain_error.value)) as wrapped_error:
        first_step(eqx_offload.offloaded(make()))
    assert str(wrapped_error.value) == str(plain_error.value)


def test_init_state_never_whole_on_device():
    # `init` is one compiled program whose state outputs are already in host memory:
    # each fresh state leaf is moved to host inside the program (nothing is returned in
    # device memory and moved afterwards).
    params = _params(jnp.float32)
    opt = eqx_offload.offloaded(optax.adamw(LR))
    jaxpr = jax.make_jaxpr(opt.init)(params)
    host = jax.memory.Space.Host
    # mu and nu of "w" and "b" are host outputs; count and the 0-d "s" moments are not.
    assert [v.aval.memory_space for v in jaxpr.jaxpr.outvars].count(host) == 4
    compiled = jax.jit(opt.init).lower(params).compile()
    kinds = [s.memory_kind for s in jtu.tree_leaves(compiled.output_shardings)]
    assert kinds.count("pinned_host") == 4 and kinds.count("device") == 3
    _assert_placement(opt.init(params))


# ---------------------------------------------------------------------------------------
# Composition with the combinators


LABELS = {"w": "a", "b": "b", "s": "b"}
MASK = {"w": True, "b": False, "s": True}


def _inject(wrap: Callable[[Any], Any]) -> optax.GradientTransformation:
    return optax.inject_hyperparams(lambda learning_rate: wrap(optax.adamw(learning_rate)))(
        learning_rate=LR
    )


def _multi_steps(inner: Any) -> optax.GradientTransformation:
    return optax.MultiSteps(inner, every_k_schedule=2).gradient_transformation()


# name -> (composition with `wrap` applied where `offloaded` goes). `wrap=identity` gives
# the unwrapped composition.
COMPOSITIONS: dict[str, Callable[[Callable[[Any], Any]], optax.GradientTransformation]] = {
    # `offloaded` outermost (the recommended order)
    "offloaded(MultiSteps(adamw))": lambda w: w(_multi_steps(optax.adamw(LR))),
    "offloaded(apply_if_finite(adamw))": lambda w: w(optax.apply_if_finite(optax.adamw(LR), 3)),
    "offloaded(inject_hyperparams(adamw))": lambda w: w(
        optax.inject_hyperparams(optax.adamw)(learning_rate=LR)
    ),
    "offloaded(masked(adam))": lambda w: w(optax.masked(optax.adam(LR), MASK)),
    "offloaded(multi_transform)": lambda w: w(
        optax.multi_transform({"a": optax.adam(LR), "b": optax.sgd(LR, momentum=0.9)}, LABELS)
    ),
    "offloaded(chain(clip, adamw))": lambda w: w(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR))
    ),
    "offloaded(schedule_free(adam))": lambda w: w(
        optax.contrib.schedule_free(optax.adam(LR, b1=0.0), LR)
    ),
    # `offloaded` as an element inside a combinator that only routes the state
    "chain(clip, offloaded(adamw))": lambda w: optax.chain(
        optax.clip_by_global_norm(1.0), w(optax.adamw(LR))
    ),
    "chain(offloaded(adam), offloaded(trace))": lambda w: optax.chain(
        w(optax.scale_by_adam()), w(optax.trace(0.9)), optax.scale(-LR)
    ),
    "inject_hyperparams(offloaded(adamw))": lambda w: _inject(w),
    "masked(offloaded(adam))": lambda w: optax.masked(w(optax.adam(LR)), MASK),
    "multi_transform(offloaded(adam), sgd)": lambda w: optax.multi_transform(
        {"a": w(optax.adam(LR)), "b": optax.sgd(LR, momentum=0.9)}, LABELS
    ),
    "schedule_free(offloaded(adam))": lambda w: optax.contrib.schedule_free(
        w(optax.adam(LR, b1=0.0)), LR
    ),
    "apply_if_finite(offloaded(adamw))": lambda w: optax.apply_if_finite(w(optax.adamw(LR)), 3),
    # computes on the state it wraps (`jnp.where`): runs on CPU, but see
    # `test_inner_order_computes_on_host`
    "MultiSteps(offloaded(adamw))": lambda w: _multi_steps(w(optax.adamw(LR))),
}

# Compositions whose jitted update has no primitive but transfers and calls touching a
# host-memory value.
NO_HOST_TOUCH = {
    name for name in COMPOSITIONS
    if name.startswith(("offloaded(", "chain(", "inject", "masked(", "multi_transform(",
                        "schedule_free("))
}


def _identity(x: Any) -> Any:
    return x


def _compose(name: str, wrap: Callable[[Any], Any]) -> optax.GradientTransformation:
    return optax.with_extra_args_support(COMPOSITIONS[name](wrap))


# Under `jit` (as they are used); eagerly too for two (eager combinators that branch with
# `lax.cond` retrace at every call, which is slow and tests nothing more).
@pytest.mark.parametrize(
    "name,mode",
    [(name, "jit") for name in COMPOSITIONS]
    + [("chain(clip, offloaded(adamw))", "eager"), ("masked(offloaded(adam))", "eager")],
)
def test_composition_transparent(name, mode):
    plain = _compose(name, _identity)
    wrapped = _compose(name, eqx_offload.offloaded)
    plain_update, wrapped_update = plain.update, wrapped.update
    params = _params(jnp.float32)
    if mode == "jit":
        plain_update, wrapped_update = jax.jit(plain_update), jax.jit(wrapped_update)
        params = jax.device_put(params, jax.devices()[0])  # committed: one compilation
    plain_params = params
    plain_state, state = plain.init(params), wrapped.init(params)
    if mode == "jit":
        plain_state = jax.device_put(plain_state, jax.devices()[0])
    assert any(isinstance(x, OffloadedState) for x in jtu.tree_leaves(
        state, is_leaf=lambda x: isinstance(x, OffloadedState)))
    assert_tree_equal(plain_state, _unwrap(state))
    _assert_placement(state)
    for step in range(4):  # MultiSteps(k=2) emits twice
        grads = _grads(params, step)
        if step == 2 and "apply_if_finite" in name:
            grads = {**grads, "b": grads["b"].at[0].set(jnp.nan)}  # the rejecting branch
        plain_updates, plain_state = plain_update(grads, plain_state, plain_params)
        updates, state = wrapped_update(grads, state, params)
        _assert_updates_equal(name, plain_updates, updates)
        assert_tree_equal(plain_state, _unwrap(state))
        _assert_placement(state)
        plain_params = optax.apply_updates(plain_params, plain_updates)
        params = optax.apply_updates(params, updates)
    assert_tree_equal(plain_params, params)


def test_multi_steps_object_accepted():
    # `optax.MultiSteps` is not a GradientTransformation; `offloaded` takes it via
    # `.gradient_transformation()`.
    opt = eqx_offload.offloaded(optax.MultiSteps(optax.adam(LR), every_k_schedule=2))
    state = opt.init(_params(jnp.float32))
    assert type(state.inner_state).__name__ == "MultiStepsState"
    _assert_placement(state)


@pytest.mark.parametrize("name", sorted(NO_HOST_TOUCH))
def test_recommended_order_no_compute_on_host(name):
    # Structural: in the jitted update, host-resident values only flow into
    # `device_put` (and the call wrappers around it); every compute primitive sees
    # device values only.
    opt = _compose(name, eqx_offload.offloaded)
    params = _params(jnp.float32)
    state = opt.init(params)
    jaxpr = jax.make_jaxpr(jax.jit(opt.update))(_grads(params, 0), state, params)
    assert any(
        getattr(v.aval, "memory_space", None) == jax.memory.Space.Host
        for v in jaxpr.jaxpr.invars
    ), "the state should enter in host memory"
    # The default update hands the state through the `cond` of a
    # `jax.lax.platform_dependent` (streamed or whole, by platform), and
    # `offloaded(MultiSteps(...))` through the `cond`s that apply it only on the last
    # mini-step (it moves the state inside them).
    allowed = TRANSFERS_AND_CALLS | {"cond"}
    assert _host_operand_eqns(jaxpr.jaxpr, allowed) == []


def test_apply_if_finite_around_offloaded_only_routes_state():
    # `apply_if_finite(offloaded(x))` hands the host state through a `lax.cond` (which
    # XLA's host offloader accepts) but computes nothing on it.
    opt = _compose("apply_if_finite(offloaded(adamw))", eqx_offload.offloaded)
    params = _params(jnp.float32)
    jaxpr = jax.make_jaxpr(opt.update)(_grads(params, 0), opt.init(params), params)
    assert set(_host_operand_eqns(jaxpr.jaxpr, TRANSFERS_AND_CALLS)) == {"cond"}


def test_inner_order_rejected_by_filter_jit():
    # (`MultiSteps(offloaded(x))` computes on the host state outside `offloaded`: the
    # canary `tests/upstream/test_upstream_optax.py` pins that Optax behaviour.)
    # eqx_offload.filter_jit checks the traced step and names the order that works,
    # instead of letting XLA run the select on the host (or fail to compile).
    opt = _compose("MultiSteps(offloaded(adamw))", eqx_offload.offloaded)
    params = _params(jnp.float32)
    step = eqx_offload.filter_jit(lambda g, s, p: opt.update(g, s, p))
    with pytest.raises(eqx_offload.CompositionError, match=r"offloaded\(optax.MultiSteps"):
        step(_grads(params, 0), opt.init(params), params)


@pytest.mark.parametrize("name", ["offloaded(MultiSteps(adamw))", "apply_if_finite(offloaded(adamw))"])
def test_working_orders_pass_filter_jit(name):
    plain = _compose(name, _identity)
    opt = _compose(name, eqx_offload.offloaded)
    params = _params(jnp.float32)
    step = eqx_offload.filter_jit(lambda g, s, p: opt.update(g, s, p))
    plain_state, state = plain.init(params), opt.init(params)
    with count_compiles("<lambda>") as compiles:
        for i in range(3):
            plain_updates, plain_state = plain.update(_grads(params, i), plain_state, params)
            updates, state = step(_grads(params, i), state, params)
            _assert_updates_equal(name, plain_updates, updates)
            assert_tree_equal(plain_state, _unwrap(state))
            _assert_placement(state)
    assert len(compiles) == 1


def test_offloaded_state_arrays_are_numpy_comparable():
    # Sanity for the helpers above: `_assert_bitwise` sees a one-bit difference.
    a = _params(jnp.float32)
    b = {**a, "w": a["w"].at[0, 0].set(np.nextafter(a["w"][0, 0], 1, dtype=np.float32))}
    with pytest.raises(AssertionError):
        assert_tree_equal(a, b)


def test_offloaded_prng_key_no_false_warning_under_jit():
    # JAX types a host-resident typed PRNG key as device memory inside `jit`
    # (`jax.typeof(k).memory_space`), so `offloaded` must not warn that a key it put on
    # host is "in device memory". Results stay bitwise equal.
    plain = optax.noisy_sgd(LR, key=jax.random.key(0))
    opt = eqx_offload.offloaded(optax.noisy_sgd(LR, key=jax.random.key(0)), where=True)
    params = jax.device_put(_params(), jax.devices()[0])
    state, plain_state = opt.init(params), jax.device_put(plain.init(params), jax.devices()[0])
    update, plain_update = jax.jit(opt.update), jax.jit(plain.update)
    for step in range(2):
        updates, state = update(_grads(params, step), state)  # filterwarnings=error
        plain_updates, plain_state = plain_update(_grads(params, step), plain_state)
        assert_tree_equal(plain_updates, updates)
        assert_tree_equal(plain_state, state.inner_state)
        assert [x.sharding.memory_kind for x in jtu.tree_leaves(state)] == ["pinned_host"] * 2


# ---------------------------------------------------------------------------------------
# Extra arguments and Python-scalar states (issue 10, items 1 and 2)


def _scaled_by_extra_arg() -> optax.GradientTransformationExtraArgs:
    """A transformation whose update multiplies by an optional keyword `scale`."""

    def init_fn(params: Any) -> Any:
        return optax.EmptyState()

    def update_fn(updates: Any, state: Any, params: Any = None, *, scale: float = 1.0,
                  **extra: Any) -> Any:
        return jtu.tree_map(lambda u: u * scale, updates), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@pytest.mark.parametrize("every_k", [1, 2])
def test_multi_steps_passes_extra_args(every_k: int) -> None:
    """`offloaded(MultiSteps(x))` passed every keyword argument to `x` before this fix
    only in name: `MultiSteps.gradient_transformation()` is a plain
    `GradientTransformation`, and `with_extra_args_support` dropped `scale=5.0`."""
    params = {"w": jnp.arange(3.0)}
    inner = optax.MultiSteps(_scaled_by_extra_arg(), every_k)
    opt = eqx_offload.offloaded(optax.MultiSteps(_scaled_by_extra_arg(), every_k))
    state, ref_state = opt.init(params), inner.init(params)
    for _ in range(3):
        updates, state = opt.update(params, state, params, scale=5.0)
        ref_updates, ref_state = inner.update(params, ref_state, params, scale=5.0)
        _assert_updates_equal("offloaded(MultiSteps", ref_updates, updates)
    assert_tree_equal(state.inner_state, ref_state)
    assert ref_state.acc_grads["w"].sharding.memory_kind == "device"
    assert state.inner_state.acc_grads["w"].sharding.memory_kind == "device"  # (by design)


class _ScalarState(NamedTuple):
    count: int
    scale: float
    mu: Any


def _python_scalar_state() -> optax.GradientTransformation:
    """A transformation whose state holds Python scalars (as some of optax's tests do)."""

    def init_fn(params: Any) -> _ScalarState:
        return _ScalarState(0, 0.5, jtu.tree_map(jnp.zeros_like, params))

    def update_fn(updates: Any, state: _ScalarState, params: Any = None) -> Any:
        mu = jtu.tree_map(lambda m, u: state.scale * m + u, state.mu, updates)
        return mu, _ScalarState(state.count + 1, state.scale, mu)

    return optax.GradientTransformation(init_fn, update_fn)


# (Under filter_jit the Python counter compiles each step and says so once: test_jit.py)
@pytest.mark.filterwarnings("ignore:filter_jit.*Python int:eqx_offload.OffloadWarning")
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_python_scalars_in_state_not_rejected(mode: str) -> None:
    """A state made by this optimizer's `init` or `update` is never a `StateError`, even
    with Python scalars in it (they were compared with their abstract value)."""
    params = {"w": jnp.arange(4.0)}
    opt = eqx_offload.offloaded(_python_scalar_state())
    inner = _python_scalar_state()
    update = opt.update if mode == "eager" else eqx_offload.filter_jit(opt.update)
    state, ref_state = opt.init(params), inner.init(params)
    for _ in range(STEPS):
        updates, state = update(params, state, params)
        ref_updates, ref_state = inner.update(params, ref_state, params)
        assert_tree_equal(updates, ref_updates)
    assert_tree_equal(state.inner_state.mu, ref_state.mu)
    assert state.inner_state.mu["w"].sharding.memory_kind == "pinned_host"


# ---------------------------------------------------------------------------------------
# Reading an offloaded state the optax ways (issue 10, item 5)


def test_hyperparams_read_through_the_state() -> None:
    params = _params(jnp.float32)
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    opt = eqx_offload.offloaded(optax.inject_hyperparams(optax.adam)(learning_rate=0.1))
    state, ref_state = opt.init(params), inner.init(params)
    assert_tree_equal(state.hyperparams, ref_state.hyperparams)
    assert_tree_equal(optax.tree.get(state, "learning_rate"), optax.tree.get(ref_state, "learning_rate"))
    assert_tree_equal(optax.tree_utils.tree_get(state, "learning_rate"), jnp.asarray(0.1))
    # Set it the optax way, through the inner state: the next update uses it.
    state = OffloadedState(optax.tree.set(state.inner_state, learning_rate=0.5))
    ref_state = optax.tree.set(ref_state, learning_rate=0.5)
    updates, state = opt.update(_grads(params, 0), state, params)
    ref_updates, ref_state = inner.update(_grads(params, 0), ref_state, params)
    assert_tree_equal(updates, ref_updates)
    assert float(state.hyperparams["learning_rate"]) == 0.5


def test_reading_brings_leaves_to_the_device_and_keeps_the_host_copy() -> None:
    params = _params(jnp.float32)
    opt = eqx_offload.offloaded(optax.adam(0.1))
    state = opt.init(params)
    mu = state.inner_state[0].mu  # the host copy
    read = OffloadedState(state.inner_state[0]).mu  # an attribute of the inner state
    assert {x.sharding.memory_kind for x in jtu.tree_leaves(read)} == {"device"}
    assert {x.sharding.memory_kind for x in jtu.tree_leaves(mu) if x.ndim} == {"pinned_host"}
    assert_tree_equal(read, mu)
    with pytest.raises(AttributeError, match="nor has its inner_state"):
        state.no_such_field  # noqa: B018
    assert not hasattr(state, "__jax_array__")  # private names are never forwarded


@pytest.mark.parametrize("every_k", [1, 3])
def test_multi_steps_has_updated(every_k: int) -> None:
    params = _params(jnp.float32)
    inner = optax.MultiSteps(optax.adam(0.1), every_k)
    opt = eqx_offload.offloaded(inner)
    state, ref_state = opt.init(params), inner.init(params)
    for i in range(4):
        _, state = opt.update(_grads(params, i), state, params)
        _, ref_state = inner.update(_grads(params, i), ref_state, params)
        assert bool(inner.has_updated(state)) == bool(inner.has_updated(ref_state))
    update = eqx_offload.filter_jit(lambda g, s, p: (opt.update(g, s, p)[1], inner.has_updated(s)))
    _, flag = update(_grads(params, 0), state, params)
    assert bool(flag) == bool(inner.has_updated(ref_state))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_schedule_free_eval_params(mode: str) -> None:
    params = _params(jnp.float32)
    inner = optax.contrib.schedule_free_adamw(0.1)
    opt = eqx_offload.offloaded(optax.contrib.schedule_free_adamw(0.1))
    state, ref_state = opt.init(params), inner.init(params)
    for i in range(3):
        updates, state = opt.update(_grads(params, i), state, params)
        ref_updates, ref_state = inner.update(_grads(params, i), ref_state, params)
        params = optax.apply_updates(params, updates)
    assert state.inner_state.z["w"].sharding.memory_kind == "pinned_host"
    eval_params = ref_eval_params = optax.contrib.schedule_free_eval_params
    if mode == "jit":  # compiled, compared with compiled (eager and jit differ in bits)
        eval_params = eqx_offload.filter_jit(eval_params)
        ref_eval_params = jax.jit(ref_eval_params)
    assert_tree_equal(eval_params(state, params), ref_eval_params(ref_state, params))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_hyperparams_written_in_place(mode: str) -> None:
    """optax documents `opt_state.hyperparams["learning_rate"] = lr`: through an
    offloaded state that write must reach the state (it once changed a copy: silently
    ignored)."""
    params = _params(jnp.float32)
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    opt = eqx_offload.offloaded(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    update = opt.update if mode == "eager" else eqx_offload.filter_jit(opt.update)
    ref_update = inner.update if mode == "eager" else jax.jit(inner.update)
    state, ref_state = opt.init(params), inner.init(params)
    state.hyperparams["learning_rate"] = jnp.asarray(0.5)
    ref_state.hyperparams["learning_rate"] = jnp.asarray(0.5)
    updates, state = update(_grads(params, 0), state, params)
    ref_updates, _ = ref_update(_grads(params, 0), ref_state, params)
    assert_tree_equal(updates, ref_updates)
    assert float(state.hyperparams["learning_rate"]) == 0.5

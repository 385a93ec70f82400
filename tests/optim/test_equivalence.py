"""`offloaded(inner)` gives bit for bit the updates and states of `inner`: one matrix of
optimizer x strategy x call (eager, `jax.jit`, `filter_jit`), each offloaded leaf in host
memory after every step; hypothesis for the long tail (random trees, chains, `where`s)."""

import functools
import inspect
import os
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import optax.contrib
import pytest
from helpers import (assert_multi_steps_updates, assert_placed, assert_tree_equal,
                     count_compiles, make_grads, make_params, tree_equal, unwrap)
from helpers import COMPOSITIONS, LR, scale_by_arg
from hypothesis import given, HealthCheck, Phase, settings
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_offload


STEPS = 3


# ------------------------------------------------------------------------ the optimizers
def _loss(params: Any) -> jax.Array:
    return sum(jnp.sum(jnp.abs(x) ** 2) for x in jtu.tree_leaves(params))


def _lbfgs_extra(params: Any) -> dict[str, Any]:
    value, grad = jax.value_and_grad(_loss)(params)
    return {"value": value, "grad": grad, "value_fn": _loss}


def _optimistic_adam() -> optax.GradientTransformation:
    with warnings.catch_warnings():  # deprecated in favour of optimistic_adam_v2
        warnings.simplefilter("ignore", DeprecationWarning)
        return optax.optimistic_adam(LR)


# The optax aliases, with the learning rate `LR` (test_every_optax_alias_is_covered).
ALIASES: dict[str, Callable[[], optax.GradientTransformation]] = {
    **{name: functools.partial(getattr(optax, name), LR) for name in [
        "adabelief", "adadelta", "adafactor", "adagrad", "adam", "adamax", "adamaxw", "adamw",
        "adan", "amsgrad", "fromage", "lamb", "lars", "lion", "nadam", "nadamw", "novograd",
        "optimistic_adam_v2", "optimistic_gradient_descent", "radam", "sign_sgd", "signum",
        "yogi", "rprop", "sm3", "lbfgs"]},
    **{f"contrib.{name}": functools.partial(getattr(optax.contrib, name), LR) for name in [
        "muon", "ademamix", "schedule_free_adamw", "adopt", "prodigy"]},
    "noisy_sgd": lambda: optax.noisy_sgd(LR, key=jax.random.key(0)),
    "optimistic_adam": _optimistic_adam, "polyak_sgd": lambda: optax.polyak_sgd(),
    "rmsprop": lambda: optax.rmsprop(LR, momentum=0.9), "sgd": lambda: optax.sgd(LR, momentum=0.9),
}
VARIANTS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd_nesterov": lambda: optax.sgd(LR, momentum=0.9, nesterov=True),
    "schedule_adam": lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, LR, 2, 10)),
    "clip_then_adamw_masked": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(
        LR, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: jnp.ndim(x) > 1, p))),
    "inject_hyperparams(adam)": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=LR),
    "chain(adam, clip)": lambda: optax.chain(optax.adam(LR), optax.clip_by_global_norm(1.0)),
    "extra_arg": lambda: optax.chain(optax.adam(LR), scale_by_arg()),
}
EXTRA: dict[str, Callable[[Any], dict[str, Any]]] = {  # extra `update` arguments
    "lbfgs": _lbfgs_extra, "polyak_sgd": lambda p: {"value": _loss(p)},
    "extra_arg": lambda p: {"factor": jnp.float32(3.0)}}
# Clipping ones and sm3 reject complex params (prodigy casts them to real, with a JAX
# DeprecationWarning: not supported); sm3 rejects 0-d ones; the masks and labels of the
# compositions name no complex leaf.
REAL_ONLY = {"rprop", "sm3", "contrib.adopt", "contrib.prodigy", *COMPOSITIONS}


def _make(name: str, wrap: Callable[[Any], Any]) -> optax.GradientTransformation:
    """Optimizer `name` with `wrap` where `offloaded` goes (the identity: unwrapped)."""
    if name in COMPOSITIONS:
        return COMPOSITIONS[name](wrap)
    return wrap({**ALIASES, **VARIANTS}[name]())


STRATEGIES: dict[str, dict[str, Any]] = {
    "auto": {}, "whole": {"group_bytes": None},
    "streamed": {"group_bytes": 0}, "streamed_4KiB": {"group_bytes": 4096},
    "streamed_where_true": {"group_bytes": 0, "where": True},  # a prologue: the count
    "host": {"compute": "host"},
    "streamed_unpinned": {"group_bytes": 0, "memory_kind": "unpinned_host"},
    "host_unpinned": {"compute": "host", "memory_kind": "unpinned_host"},
    "host_dtype": {"host_dtype": jnp.bfloat16},
    "host_dtype_streamed": {"host_dtype": jnp.bfloat16, "group_bytes": 0},
}
# The per-leaf optimizers (and global statistics of the gradients): stream and run on host.
STREAMABLE = ["adam", "adamw", "lion", "sgd", "sgd_nesterov", "rmsprop", "adagrad", "nadam",
              "amsgrad", "adafactor", "lamb", "clip_then_adamw_masked", "schedule_adam",
              "inject_hyperparams(adam)", "extra_arg"]
FAST = {"adam", "adamw", "sgd", "adafactor", "lion", "lbfgs"}  # the rest: `slow`
MESHES = {"x": ((4,), ("x",), P("x")), "x_y": ((2, 2), ("x", "y"), P("x", "y")),
          "cols": ((2, 2), ("x", "y"), P(None, "y"))}


def _case(name: str, strategy: str, mode: str, layout: str = "one") -> Any:
    marks = [] if name in FAST and strategy in ("auto", "whole") else [pytest.mark.slow]
    if strategy not in ("auto", "whole"):  # what XLA versions could break: newest too
        marks.append(pytest.mark.both)
    return pytest.param(name, strategy, mode, layout, marks=marks,
                        id=f"{name}-{strategy}-{mode}-{layout}")


CASES = [
    *[_case(n, "auto", m) for n in sorted(ALIASES) for m in ("eager", "jax.jit")],
    *[_case(n, s, "jax.jit") for n in STREAMABLE for s in ("streamed", "streamed_4KiB", "host")],
    *[_case(n, "auto", "jax.jit") for n in COMPOSITIONS],
    _case("chain(clip, offloaded(adamw))", "auto", "eager"),
    _case("masked(offloaded(adam))", "auto", "eager"),
    _case("chain(adam, clip)", "whole", "jax.jit"),
    *[_case(n, "auto", "filter_jit")
      for n in ("offloaded(MultiSteps(adamw))", "apply_if_finite(offloaded(adamw))")],
    *[_case("adamw", s, m) for s in ("whole", "streamed", "host") for m in ("eager", "filter_jit")],
    *[_case("nadam", s, "eager") for s in ("streamed_unpinned", "host_unpinned")],
    *[_case(n, "host_dtype", m) for n in ("adam", "adafactor", "sgd")
      for m in ("eager", "filter_jit")],
    _case("adam", "host_dtype_streamed", "jax.jit"),
    _case("adam", "streamed_where_true", "jax.jit"),
    *[_case("adam", "auto", "filter_jit", layout) for layout in sorted(MESHES)],
    *[_case("adam", s, "jax.jit", "x") for s in ("streamed", "streamed_4KiB", "host")],
]


# ------------------------------------------------------------------------ the harness
def _narrowed(state: Any, dtype: Any) -> Any:
    """What `host_dtype` keeps of a state: floating leaves of >= 1 dimension, in `dtype`."""
    def cut(x: Any) -> Any:
        wider = jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > jnp.dtype(dtype).itemsize
        return x.astype(dtype) if isinstance(x, jax.Array) and x.ndim and wider else x
    return jtu.tree_map(cut, state)


def _widened(state: Any, like: Any) -> Any:
    return jtu.tree_map(lambda x, y: x.astype(y.dtype), state, like)


def _emulation(inner: optax.GradientTransformation, params: Any, dtype: Any) -> Any:
    """`inner.update` on a state kept in `dtype`: widened, updated, narrowed (one program
    under `jit`, as in `offloaded`: XLA contracts multiply-adds by program)."""
    like = inner.init(params)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        updates, state = inner.update(updates, _widened(state, like), params, **extra)
        return updates, _narrowed(state, dtype)
    return update


def _sharded_params(layout: str) -> dict[str, jax.Array]:
    shape, names, spec = MESHES[layout]
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[4:8]).reshape(shape), names)  # not device 0
    w = (np.arange(8 * 12, dtype=np.float32).reshape(8, 12) - 40.0) / 3.0
    return {"w": jax.device_put(w, NamedSharding(mesh, spec)),
            "b": jax.device_put(jnp.linspace(-1, 1, 8), NamedSharding(mesh, P(spec[0])))}


def _assert_shards(ref: Any, tree: Any, params: dict[str, jax.Array]) -> None:
    """Every shard (replicas included) holds the reference's values; each state leaf has its
    parameter's sharding."""
    specs = {p.shape: p.sharding.spec for p in params.values()}
    for r, x in zip(jtu.tree_leaves(ref), jtu.tree_leaves(tree), strict=True):
        if x.ndim:
            assert x.sharding.spec == specs[x.shape], (x.sharding, specs)
            for shard in x.addressable_shards:
                assert np.array_equal(np.asarray(shard.data), np.asarray(r)[shard.index])


JITS: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "eager": lambda f: f,
    "jax.jit": lambda f: jax.jit(f, static_argnames="value_fn"),  # lbfgs's is a function
    "filter_jit": eqx_offload.filter_jit,
}


@pytest.mark.parametrize("name,strategy,mode,layout", CASES)
def test_equal_to_unwrapped(name: str, strategy: str, mode: str, layout: str) -> None:
    """`STEPS` steps: updates, states and parameters bitwise the unwrapped optimizer's,
    every state leaf where `assert_placed` says, the updates on the device; compiled once
    by `filter_jit`, and by `jax.jit` when streamed or computed on host."""
    options, extra = STRATEGIES[strategy], EXTRA.get(name, lambda p: {})
    multi = name.startswith("offloaded(MultiSteps")  # +0.0 where MultiSteps discards `0 * u`
    assert_updates = assert_multi_steps_updates if multi else assert_tree_equal
    plain = optax.with_extra_args_support(_make(name, lambda x: x))
    wrapped = optax.with_extra_args_support(
        _make(name, functools.partial(eqx_offload.offloaded, **options)))
    if layout != "one":
        params = _sharded_params(layout)
    else:
        complex_ok = name not in REAL_ONLY and strategy in ("auto", "whole")
        params = make_params(*["complex"] * complex_ok, *["half"] * ("host_dtype" in options),
                             *["no_scalar"] * (name == "sm3"))
    ref_update, ref_state = plain.update, plain.init(params)
    if "host_dtype" in options:
        ref_update, ref_state = _emulation(plain, params, jnp.bfloat16), _narrowed(ref_state, jnp.bfloat16)
    # Outside `jit` a streamed or host-compute update is compiled: it equals the jitted one.
    ref_mode = "jax.jit" if mode == "eager" and not strategy.startswith(("auto", "whole", "host_dtype")) else mode
    ref_update = (eqx.filter_jit if ref_mode == "filter_jit" else JITS[ref_mode])(ref_update)
    update = JITS[mode](wrapped.update)
    if layout == "one":  # committed as `state` is: one compilation each
        ref_state = jax.device_put(ref_state, jax.devices()[0])
    state, ref_params = wrapped.init(params), params
    where, kind = options.get("where"), options.get("memory_kind", "pinned_host")
    assert_tree_equal(ref_state, unwrap(state))
    assert_placed(state, where, kind)
    compiles: list[str] = []
    for step in range(4 if name in COMPOSITIONS else STEPS):  # MultiSteps(k=2) emits twice
        grads = make_grads(params, step, nonfinite="apply_if_finite" in name)
        ref_updates, ref_state = ref_update(grads, ref_state, ref_params, **extra(ref_params))
        with count_compiles() as compiled:
            updates, state = update(grads, state, params, **extra(params))
        compiles += compiled
        assert_updates(ref_updates, updates)
        assert_tree_equal(ref_state, unwrap(state))
        assert_placed(state, where, kind)
        assert {u.sharding.memory_kind for u in jtu.tree_leaves(updates)} == {"device"}
        ref_params = optax.apply_updates(ref_params, ref_updates)
        params = optax.apply_updates(params, updates)
    assert_tree_equal(ref_params, params)
    if layout != "one":
        _assert_shards(ref_state, unwrap(state), params)
    if mode == "filter_jit" or (mode == "jax.jit" and strategy not in ("auto", "whole")):
        assert len(compiles) == 1, compiles


def test_every_optax_alias_is_covered() -> None:
    from optax._src import alias

    aliases = {name for name, value in vars(alias).items() if not name.startswith("_")
               and inspect.isfunction(getattr(value, "func", value))
               and getattr(value, "func", value).__module__ == alias.__name__}
    assert len(aliases) >= 27 and all(hasattr(optax, name) for name in aliases)
    assert not aliases - set(ALIASES), sorted(aliases - set(ALIASES))


@pytest.mark.parametrize("name", ["rprop", "sm3", "contrib.adopt"])
def test_complex_rejected_like_the_unwrapped_optimizer(name: str) -> None:
    """Where an optimizer rejects complex params, the offloaded one raises its error."""
    params = make_params("complex", "no_scalar")

    def first_step(opt: optax.GradientTransformation) -> None:
        opt.update(make_grads(params, 0), opt.init(params), params)

    with pytest.raises((ValueError, TypeError)) as plain_error:
        first_step(_make(name, lambda x: x))
    with pytest.raises(type(plain_error.value)) as wrapped_error:
        first_step(_make(name, eqx_offload.offloaded))
    assert str(wrapped_error.value) == str(plain_error.value)


def test_the_checks_can_fail() -> None:
    """`assert_tree_equal` sees one bit, `assert_placed` a leaf in the wrong memory, and
    the emulation of `host_dtype` is the rounding it stands for (not the float32 state)."""
    a = make_params()
    b = {**a, "scale": jnp.nextafter(a["scale"], 1.0)}
    with pytest.raises(AssertionError):
        assert_tree_equal(a, b)
    state = eqx_offload.offloaded(optax.adam(LR)).init(a)
    with pytest.raises(AssertionError):
        assert_placed(eqx_offload.to_device(state))
    inner, params = optax.adam(LR), make_params("half")
    update, wide = _emulation(inner, params, jnp.bfloat16), inner.init(params)
    state, rounded, full = _narrowed(wide, jnp.bfloat16), wide, wide
    for step in range(3):  # eagerly: op by op, nothing contracted
        updates, state = update(make_grads(params, step), state, params)
        ref_updates, rounded = inner.update(make_grads(params, step), rounded, params)
        rounded = _widened(_narrowed(rounded, jnp.bfloat16), wide)
        _, full = inner.update(make_grads(params, step), full, params)
        assert_tree_equal((updates, _widened(state, wide)), (ref_updates, rounded))
    assert not tree_equal(_widened(state, wide), full)


# ------------------------------------------------------------------------ training steps
class _Net(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout  # a Python float and a bool among the leaves
    scale: float
    depth: int

    def __init__(self) -> None:
        self.linear = eqx.nn.Linear(3, 2, key=jax.random.key(0))
        self.dropout = eqx.nn.Dropout(0.1)
        self.scale, self.depth = 0.5, 2


@pytest.mark.parametrize("init_with", ["arrays", "inexact"])
@pytest.mark.parametrize("mode", ["eager", "filter_jit"])
def test_whole_model_as_params(init_with: str, mode: str) -> None:
    """As plain optax: `init` with the model's (floating) arrays, `update` with the whole
    model, Python scalars among its leaves."""
    model = _Net()
    grads = jax.tree.map(jnp.ones_like, eqx.filter(model, eqx.is_inexact_array))
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
    opt = eqx_offload.offloaded(inner)
    like = eqx.filter(model, eqx.is_array if init_with == "arrays" else eqx.is_inexact_array)
    state, ref_state = opt.init(like), inner.init(like)
    update = opt.update if mode == "eager" else eqx_offload.filter_jit(opt.update)
    ref_update = inner.update if mode == "eager" else eqx.filter_jit(inner.update)
    for _ in range(3):
        updates, state = update(grads, state, model)
        ref_updates, ref_state = ref_update(grads, ref_state, model)
        assert_tree_equal(updates, ref_updates)
    assert_tree_equal(state.inner_state, ref_state)
    assert_placed(state)


@pytest.mark.parametrize("strategy", ["auto", "streamed", "host"])
def test_training_step_donated(strategy: str) -> None:
    """An `eqx.nn.MLP` trained by `filter_jit(donate="all")`: losses, model and state
    bitwise the unwrapped loop's, every input consumed, the state in host memory and the
    model and gradients on the device after every step, one compilation."""
    model = eqx.nn.MLP(5, 1, 16, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, 5))
    y = jnp.sin(x).sum(axis=1, keepdims=True)

    def make_step(opt: Any, jit: Any) -> Any:
        @jit
        def step(model: Any, state: Any) -> Any:
            loss, grads = eqx.filter_value_and_grad(
                lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
            updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state, loss, grads
        return step

    inner, opt = optax.adamw(3e-2, weight_decay=1e-2), eqx_offload.offloaded(
        optax.adamw(3e-2, weight_decay=1e-2), **STRATEGIES[strategy])
    ref_step = make_step(inner, eqx.filter_jit)
    step = make_step(opt, eqx_offload.filter_jit(donate="all"))
    ref_model = jax.tree.map(lambda v: jnp.copy(v) if eqx.is_array(v) else v, model)
    ref_state, state = inner.init(eqx.filter(model, eqx.is_array)), opt.init(eqx.filter(model, eqx.is_array))
    losses, compiles = [], []
    for _ in range(4):
        donated = jtu.tree_leaves(eqx.filter((model, state), eqx.is_array))
        with count_compiles("step") as compiled:
            model, state, loss, grads = step(model, state)
        compiles += compiled
        ref_model, ref_state, ref_loss, _ = ref_step(ref_model, ref_state)
        assert all(leaf.is_deleted() for leaf in donated)
        assert_tree_equal((loss, eqx.filter(model, eqx.is_array), state.inner_state),
                          (ref_loss, eqx.filter(ref_model, eqx.is_array), ref_state))
        assert_placed((model, grads, state))
        losses.append(float(loss))
    assert len(set(losses)) == 4 and len(compiles) == 1  # it trains; one compilation


# ------------------------------------------------------------------------ the long tail
# Random pytrees, optimizer chains and `where`s. Profile `ci`: few examples (each compiles
# steps), the same on every run, no shrinking (a failure prints its draws as they are);
# `HYPOTHESIS_PROFILE=long pytest tests/optim/test_equivalence.py -k random`: 400 each.
settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("long", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# Random patterns (among them "nothing") may select no leaf (that warning: test_errors.py).
NOTHING_SELECTED = "ignore:(?s).*selects no array leaf:eqx_offload.errors.OffloadWarning"


class Pair(NamedTuple):
    first: Any
    second: Any


@st.composite
def trees(draw: st.DrawFn, depth: int = 0) -> Any:
    if depth >= 2 or draw(st.booleans()):
        shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
        dtype = draw(st.sampled_from([np.float32, np.float32, np.float32, jnp.bfloat16]))
        rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)
    kind = draw(st.sampled_from([dict, list, tuple, Pair]))
    children = [draw(trees(depth + 1)) for _ in range(2 if kind is Pair else draw(st.integers(1, 3)))]
    if kind is dict:
        return {f"k{i}": c for i, c in enumerate(children)}
    return children if kind is list else tuple(children) if kind is tuple else Pair(*children)


RANDOM_ALIASES: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(1e-2), "momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2), "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2), "lion": lambda: optax.lion(1e-3),
    "rmsprop": lambda: optax.rmsprop(1e-2, momentum=0.5), "adagrad": lambda: optax.adagrad(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "lamb": lambda: optax.lamb(1e-2), "adabelief": lambda: optax.adabelief(1e-2),
}


@st.composite
def optimizers(draw: st.DrawFn, params: Any, depth: int = 0) -> tuple[str, Any]:
    """`(description, transformation)`. (No `MultiSteps`: inside a jitted step its
    offloaded updates are MultiSteps' as numbers, not bits; test_accumulate.py.)"""
    name = draw(st.sampled_from(sorted(RANDOM_ALIASES)))
    base = RANDOM_ALIASES[name]()
    combinator = "none" if depth else draw(st.sampled_from(
        ["none", "chain", "masked", "multi_transform", "inject", "apply_if_finite", "decay"]))
    if combinator == "chain":
        return f"chain(clip, {name})", optax.chain(optax.clip_by_global_norm(1.0), base)
    if combinator == "masked":
        return f"masked({name})", optax.masked(base, jax.tree.map(lambda _: draw(st.booleans()), params))
    if combinator == "multi_transform":
        other_name, other = draw(optimizers(params, depth + 1))
        labels = jax.tree.map(lambda _: draw(st.sampled_from(["a", "b"])), params)
        return f"multi_transform({name}, {other_name})", optax.multi_transform({"a": base, "b": other}, labels)
    if combinator == "inject":
        return "inject_hyperparams(adam)", optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b1=0.8)
    if combinator == "apply_if_finite":
        return f"apply_if_finite({name})", optax.apply_if_finite(base, 2)
    if combinator == "decay":
        return f"chain(decay, {name})", optax.chain(optax.add_decayed_weights(1e-3), base)
    return name, base


PATTERNS = [".*", ".*mu.*", ".*/nu/.*", ".*(mu|nu|v_row|v_col|trace).*", "0/.*", ".*k0.*", "nothing"]


@st.composite
def wheres(draw: st.DrawFn, depth: int = 0) -> tuple[Any, ...]:
    """A description of a `where` (the filters are built in the test body: beartype's
    checks of their constructors use `random`, which hypothesis forbids in a strategy)."""
    kinds = ["pattern", "min_bytes", "min_ndim"] + ["and", "or", "not"] * (depth < 2)
    kind = draw(st.sampled_from(kinds + ["default", "bool", "callable"] * (depth == 0)))
    if kind in ("default", "callable"):
        return (kind,)
    if kind in ("bool", "pattern", "min_bytes", "min_ndim"):
        return (kind, draw({"bool": st.booleans(), "pattern": st.sampled_from(PATTERNS),
                            "min_bytes": st.sampled_from([0, 1, 4, 16, 64]),
                            "min_ndim": st.integers(0, 3)}[kind]))
    return (kind, *[draw(wheres(depth + 1)) for _ in range(1 if kind == "not" else 2)])


def build_where(spec: tuple[Any, ...]) -> Any:
    """The `where` a description stands for (`None`: the default of `offloaded`)."""
    kind, *args = spec
    built = {"default": lambda: None, "bool": lambda: args[0], "callable": lambda: lambda x: x.size > 2,
             "pattern": lambda: eqx_offload.pattern(args[0]),
             "min_bytes": lambda: eqx_offload.min_bytes(args[0]),
             "min_ndim": lambda: eqx_offload.min_ndim(args[0]),
             "not": lambda: ~build_where(args[0]),
             "and": lambda: build_where(args[0]) & build_where(args[1]),
             "or": lambda: build_where(args[0]) | build_where(args[1])}
    return built[kind]()


@pytest.mark.filterwarnings(NOTHING_SELECTED)
@settings(PROFILE)
@given(data=st.data())
def test_random_equal_to_unwrapped(data: st.DataObject) -> None:
    """Random params, optimizer and `where`, donated `filter_jit` steps: bitwise the unwrapped
    optimizer's, placed as `where` says, parameters consumed, one compile per signature."""
    tree = data.draw(trees(), label="params")
    tree = tree if isinstance(tree, (dict, list, tuple)) else {"only": tree}
    params = jax.tree.map(jnp.asarray, tree)
    text, inner = data.draw(optimizers(params), label="optimizer")
    where_spec = data.draw(wheres(), label="where")
    where = build_where(where_spec)
    opt = eqx_offload.offloaded(inner) if where is None else eqx_offload.offloaded(inner, where)
    description = f"{text}, where={where_spec}"

    def make_step(opt: Any, jit: Any, name: str) -> Any:
        def step(p: Any, s: Any, g: Any) -> Any:
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s, updates
        step.__name__ = name  # only `step`'s compiles are counted
        return jit(step)

    step = make_step(opt, eqx_offload.filter_jit(donate="all"), "step")
    ref_step = make_step(inner, jax.jit, "ref_step")
    ref_p, ref_state = jax.tree.map(jnp.copy, params), inner.init(params)  # `step` donates
    p, state = params, opt.init(params)
    assert_tree_equal(ref_state, state.inner_state)
    assert_placed(state, where)
    signatures = set()
    with count_compiles("step") as compiles:
        for k in range(STEPS):
            grads = make_grads(ref_p, k, nonfinite=True)  # `apply_if_finite` skips step 1
            ref_p, ref_state, ref_updates = ref_step(ref_p, ref_state, grads)
            old = p
            signatures.add(tuple((x.shape, x.dtype) for x in jtu.tree_leaves((p, state, grads))))
            p, state, updates = step(p, state, grads)
            assert tree_equal((updates, state.inner_state, p), (ref_updates, ref_state, ref_p)), (
                description, k)
            assert_placed(state, where)
            # (XLA may decline a state buffer's donation: adafactor's constant `v_row`.)
            assert all(x.is_deleted() for x in jtu.tree_leaves(old)), description
    # `inject_hyperparams` promotes bfloat16 moments of mixed params: a new signature; the
    # uncommitted first params compile once more.
    assert len(compiles) <= len(signatures) + 1, description


@pytest.mark.filterwarnings(NOTHING_SELECTED)
@settings(PROFILE)
@given(tree=trees(), where_spec=wheres())
def test_random_to_host_selects_what_where_says(tree: Any, where_spec: tuple[Any, ...]) -> None:
    """`to_host` moves exactly what `where` selects; `to_device` brings it back bitwise."""
    where = build_where(where_spec)
    tree = jax.tree.map(jnp.asarray, tree)
    moved = eqx_offload.to_host(tree) if where is None else eqx_offload.to_host(tree, where)
    assert_placed(eqx_offload.OffloadedState(moved), True if where is None else where)
    back = eqx_offload.to_device(moved)
    assert_tree_equal(back, tree)
    assert_placed(back)


def test_profiles_are_bounded() -> None:
    """CI runs the bounded profile unless asked otherwise."""
    assert settings.get_profile("ci").max_examples <= 20 and settings.get_profile("long").max_examples >= 200
    if "HYPOTHESIS_PROFILE" not in os.environ:
        assert PROFILE.max_examples == settings.get_profile("ci").max_examples

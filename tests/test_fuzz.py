"""Property tests with hypothesis: random pytrees, random optimizer chains and random
`where` specs.

Properties, over several jitted steps:

1. `offloaded(inner, where)` gives updates and states bitwise equal to `inner`'s;
2. between steps every leaf of the inner state that `where` selects is in host memory
   (`pinned_host`), every other leaf in device memory, and every donated input is
   consumed.

Example counts are bounded so CI stays fast (profile `ci`, the default). A longer run,
by hand:

    HYPOTHESIS_PROFILE=long python -m pytest -q tests/test_fuzz.py

(`long`: 400 examples per test, no time limit; about 8 minutes on 2 cores). The
profiles are applied per test
(`@settings(PROFILE)`), not loaded globally, so other test modules keep their own.
"""

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from hypothesis import given, HealthCheck, Phase, settings

import eqx_offload
from helpers import count_compiles, tree_bits as bits


settings.register_profile(
    # Every example compiles two training steps: few examples, the same ones on every
    # run, and no shrinking (a failure prints the drawn optimizer and `where` as is).
    "ci", max_examples=12, deadline=None, derandomize=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long", max_examples=400, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Random patterns (among them "nothing") select no leaf on purpose: the warning a user
# gets for that is tests/test_errors.py's.
pytestmark = pytest.mark.filterwarnings("ignore:.*selects no array leaf:eqx_offload.OffloadWarning")
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
STEPS = 3


# ---------------------------------------------------------------------------------------
# Random pytrees of parameters.


class Pair(NamedTuple):
    first: Any
    second: Any


def arrays(draw: st.DrawFn) -> np.ndarray:
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3)))
    dtype = draw(st.sampled_from([np.float32, np.float32, np.float32, jnp.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return values.astype(dtype)


@st.composite
def trees(draw: st.DrawFn, depth: int = 0) -> Any:
    if depth >= 2 or draw(st.booleans()):
        return arrays(draw)
    kind = draw(st.sampled_from(["dict", "list", "tuple", "namedtuple"]))
    n = 2 if kind == "namedtuple" else draw(st.integers(1, 3))
    children = [draw(trees(depth + 1)) for _ in range(n)]
    if kind == "dict":
        return {f"k{i}": c for i, c in enumerate(children)}
    if kind == "list":
        return children
    if kind == "tuple":
        return tuple(children)
    return Pair(*children)


@st.composite
def params_trees(draw: st.DrawFn) -> Any:
    tree = draw(trees())
    return tree if isinstance(tree, (dict, list, tuple)) else {"only": tree}


# ---------------------------------------------------------------------------------------
# Random optimizers: aliases and combinators.

ALIASES: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(1e-2),
    "momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "rmsprop": lambda: optax.rmsprop(1e-2, momentum=0.5),
    "adagrad": lambda: optax.adagrad(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "lamb": lambda: optax.lamb(1e-2),
    "adabelief": lambda: optax.adabelief(1e-2),
}


@st.composite
def optimizers(draw: st.DrawFn, params: Any, depth: int = 0) -> tuple[str, optax.GradientTransformation]:
    """`(description, transformation)` built from the pool."""
    name = draw(st.sampled_from(sorted(ALIASES)))
    base = ALIASES[name]()
    if depth >= 1:
        return name, base
    # (`MultiSteps` is not drawn: `offloaded(MultiSteps(...))` keeps its accumulator on
    # the device and applies the inner update in a branch, so inside a jitted step its
    # updates and parameters are MultiSteps' as numbers, not bits; its own matrix is
    # tests/test_accumulate.py.)
    combinator = draw(st.sampled_from(["none", "chain", "masked", "multi_transform", "inject",
                                       "apply_if_finite", "decay"]))
    if combinator == "none":
        return name, base
    if combinator == "chain":
        return f"chain(clip, {name})", optax.chain(optax.clip_by_global_norm(1.0), base)
    if combinator == "masked":
        mask = jax.tree.map(lambda _: draw(st.booleans()), params)
        return f"masked({name})", optax.masked(base, mask)
    if combinator == "multi_transform":
        other_name, other = draw(optimizers(params, depth + 1))
        labels = jax.tree.map(lambda _: draw(st.sampled_from(["a", "b"])), params)
        return (f"multi_transform({name}, {other_name})",
                optax.multi_transform({"a": base, "b": other}, labels))
    if combinator == "inject":
        return "inject_hyperparams(adam)", optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b1=0.8)
    if combinator == "apply_if_finite":
        return f"apply_if_finite({name})", optax.apply_if_finite(base, 2)
    return f"chain(decay, {name})", optax.chain(optax.add_decayed_weights(1e-3), base)


# ---------------------------------------------------------------------------------------
# Random `where` specs.

PATTERNS = [".*", ".*mu.*", ".*/nu/.*", ".*(mu|nu|v_row|v_col|trace).*", "0/.*", ".*k0.*", "nothing"]


# The strategies draw plain descriptions; `build_where` makes the filters in the test
# body (the pytest hook type-checks `eqx_offload`'s constructors with beartype, which uses
# the `random` module, and hypothesis forbids that inside a strategy).


@st.composite
def filters(draw: st.DrawFn, depth: int = 0) -> tuple[Any, ...]:
    kind = draw(st.sampled_from(["pattern", "min_bytes", "min_ndim"] + (["and", "or", "not"] if depth < 2 else [])))
    if kind == "pattern":
        return ("pattern", draw(st.sampled_from(PATTERNS)))
    if kind == "min_bytes":
        return ("min_bytes", draw(st.sampled_from([0, 1, 4, 16, 64])))
    if kind == "min_ndim":
        return ("min_ndim", draw(st.integers(0, 3)))
    if kind == "not":
        return ("not", draw(filters(depth + 1)))
    return (kind, draw(filters(depth + 1)), draw(filters(depth + 1)))


@st.composite
def wheres(draw: st.DrawFn) -> tuple[Any, ...]:
    kind = draw(st.sampled_from(["default", "bool", "filter", "callable"]))
    if kind == "default":
        return ("default",)
    if kind == "bool":
        return ("bool", draw(st.booleans()))
    if kind == "callable":
        return ("callable",)
    return draw(filters())


def build_where(spec: tuple[Any, ...]) -> Any:
    """The `where` a description stands for (`None`: the default of `offloaded`)."""
    kind = spec[0]
    if kind == "default":
        return None
    if kind == "bool":
        return spec[1]
    if kind == "callable":
        return lambda x: x.size > 2
    if kind == "pattern":
        return eqx_offload.pattern(spec[1])
    if kind == "min_bytes":
        return eqx_offload.min_bytes(spec[1])
    if kind == "min_ndim":
        return eqx_offload.min_ndim(spec[1])
    if kind == "not":
        return ~build_where(spec[1])
    a, b = build_where(spec[1]), build_where(spec[2])
    return a & b if kind == "and" else a | b


def oracle_path(path: tuple[Any, ...]) -> str:
    """A key path as the docs say `pattern` sees it (dict keys, sequence indices and
    attribute names joined by `/`), written here independently of the package."""
    parts = []
    for key in path:
        for attribute in ("key", "idx", "name"):
            if hasattr(key, attribute):
                parts.append(str(getattr(key, attribute)))
                break
        else:
            raise AssertionError(f"unexpected key {key!r}")
    return "/".join(parts)


def expected_selection(inner_state: Any, where: Any) -> list[bool]:
    """Which leaves of the inner state `where` selects, computed here from the spec (only
    array leaves can be selected; a `Filter` sees the leaf's path)."""
    if where is None:
        where = eqx_offload.min_ndim(1)
    result = []
    for path, leaf in jtu.tree_flatten_with_path(inner_state)[0]:
        if not isinstance(leaf, jax.Array):
            result.append(False)
        elif isinstance(where, bool):
            result.append(where)
        elif isinstance(where, eqx_offload.Filter):
            result.append(bool(where(leaf, oracle_path(path))))
        else:
            result.append(bool(where(leaf)))
    return result


# ---------------------------------------------------------------------------------------
# The properties.


def gradients(params: Any, k: int) -> Any:
    """Deterministic, different gradients for step `k` (sometimes with a non-finite
    entry, which `apply_if_finite` must skip in both runs)."""
    def one(x: jax.Array) -> jax.Array:
        g = jnp.sin(x.astype(jnp.float32) * (k + 1) + k).astype(x.dtype)
        if k == 1 and x.size > 3:
            g = g.at[(0,) * x.ndim].set(jnp.inf)
        return g
    return jax.tree.map(one, params)


def check_placement(state: Any, where: Any, description: str) -> None:
    leaves = jtu.tree_flatten_with_path(state.inner_state)[0]
    for (path, leaf), selected in zip(leaves, expected_selection(state.inner_state, where)):
        want = "pinned_host" if selected else "device"
        assert leaf.sharding.memory_kind == want, (description, oracle_path(path), leaf.sharding.memory_kind)


@settings(PROFILE)
@given(data=st.data())
def test_offloaded_equals_unwrapped(data: st.DataObject) -> None:
    params = jax.tree.map(jnp.asarray, data.draw(params_trees(), label="params"))
    opt_text, inner = data.draw(optimizers(params), label="optimizer")
    where_spec = data.draw(wheres(), label="where")
    where = build_where(where_spec)
    description = f"{opt_text}, where={where_spec}"
    opt = eqx_offload.offloaded(inner) if where is None else eqx_offload.offloaded(inner, where)

    @eqx_offload.filter_jit(donate="all")
    def step(p: Any, s: Any, g: Any) -> Any:
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, updates

    @jax.jit
    def reference_step(p: Any, s: Any, g: Any) -> Any:
        updates, s = inner.update(g, s, p)
        return optax.apply_updates(p, updates), s, updates

    ref_p, ref_state = jax.tree.map(jnp.copy, params), inner.init(params)  # `step` donates `params`
    p, state = params, opt.init(params)
    assert bits(state.inner_state) == bits(ref_state), description
    check_placement(state, where, description)
    signatures = set()
    with count_compiles("step") as compiles:
        for k in range(STEPS):
            grads = gradients(ref_p, k)
            ref_p, ref_state, ref_updates = reference_step(ref_p, ref_state, grads)
            old = (p, state, grads)
            signatures.add(tuple((x.shape, x.dtype) for x in jtu.tree_leaves(old)))
            p, state, updates = step(p, state, grads)  # donates the gradients too
            assert bits(updates) == bits(ref_updates), (description, k)
            assert bits(state.inner_state) == bits(ref_state), (description, k)
            assert bits(p) == bits(ref_p), (description, k)
            check_placement(state, where, description)
            # Donation is a hint XLA may decline per buffer (adafactor's constant `v_row`,
            # `apply_if_finite`'s scalars), but the parameters are always consumed.
            assert all(x.is_deleted() for x in jtu.tree_leaves(old[0])), description
    # One compilation per distinct shapes-and-dtypes of the arguments: one, unless the
    # inner optimizer changes a state dtype (`inject_hyperparams` promotes bfloat16
    # moments when the params mix dtypes). Layouts and memory kinds never add one.
    assert len(compiles) == len(signatures), description


@settings(PROFILE)
@given(params=params_trees(), where=wheres())
def test_to_host_selects_what_where_says(params: Any, where: tuple[Any, ...]) -> None:
    """`to_host` with the same random specs moves exactly the leaves `where` selects, and
    `to_device` brings them back bit for bit."""
    where_text, spec = where, build_where(where)
    tree = jax.tree.map(jnp.asarray, params)
    moved = eqx_offload.to_host(tree) if spec is None else eqx_offload.to_host(tree, spec)
    selected = expected_selection(tree, True if spec is None else spec)
    for (path, leaf), chosen in zip(jtu.tree_flatten_with_path(moved)[0], selected):
        assert leaf.sharding.memory_kind == ("pinned_host" if chosen else "device"), (where_text, path)
    back = eqx_offload.to_device(moved)
    assert bits(back) == bits(tree)
    assert {x.sharding.memory_kind for x in jtu.tree_leaves(back)} <= {"device"}


def test_profiles_are_bounded() -> None:
    """CI runs the bounded profile unless asked otherwise."""
    ci = settings.get_profile("ci")
    assert ci.max_examples <= 20 and ci.deadline is None
    assert settings.get_profile("long").max_examples >= 200
    if "HYPOTHESIS_PROFILE" not in os.environ:
        assert PROFILE.max_examples == ci.max_examples

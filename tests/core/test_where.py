"""`where` filter specs: every form, the path-aware helpers, the combinators, the errors."""

import collections
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import memory_kinds
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import TypeCheckError

import eqx_offload
from eqx_offload import min_bytes, min_ndim, pattern
from eqx_offload.errors import WhereError
from eqx_offload.types import Filter
from eqx_offload._core.leaves import path_to_str
from eqx_offload._core.where import leaf_mask, structure_divergence


Pair = collections.namedtuple("Pair", "first second")


class Linear(eqx.Module):
    weight: Any
    bias: Any
    name: str = eqx.field(static=True, default="linear")


def _chain_state() -> Any:
    params = {"layers": [{"weight": jnp.ones((4, 3)), "bias": jnp.zeros(3)}], "scale": jnp.ones(())}
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)).init(params)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


TREES = {
    "chain": _chain_state,
    "nested": lambda: {"a": [jnp.ones(2), jnp.ones(3)], "b": (jnp.ones(4), jnp.ones(())),
                       "c": jnp.ones(1)},
    "model": lambda: {"encoder": Linear(jnp.ones((3, 2)), jnp.ones(2)),
                      "head": Linear(jnp.ones(2), None)},
    "pair": lambda: Pair(Linear(jnp.ones(2), jnp.ones(1)), [jnp.ones(1)]),
    "scoped": lambda: {"opt": {"mu": jnp.ones(2), "nu": jnp.ones(2)}, "other": {"mu": jnp.ones(2)}},
    "mixed": lambda: {"a": jnp.ones(3), "b": [jnp.ones(()), "x", None, 2.0]},
    "dtypes": lambda: {"a": jnp.ones(3), "b": jnp.ones((), jnp.int32), "c": "text",
                       "d": np.ones(2)},
    "ndims": lambda: {"count": jnp.zeros((), jnp.int32), "v": jnp.ones(3), "m": jnp.ones((2, 0)),
                      "s": 1.0},
    # bytes: 16, 16, 14, 16, 16, 4, 0, 16
    "sizes": lambda: {"f32x4": jnp.ones(4), "bf16x8": jnp.ones(8, jnp.bfloat16),
                      "f16x7": jnp.ones(7, jnp.float16), "c64x2": jnp.ones(2, jnp.complex64),
                      "bool16": jnp.ones(16, jnp.bool_), "count": jnp.zeros((), jnp.int32),
                      "empty": jnp.ones((3, 0)), "np": np.ones(4, np.float32)},
    "errors": lambda: {"a": jnp.ones(3), "b": [jnp.ones(2), jnp.zeros(())]},
    "linear": lambda: Linear(jnp.ones(2), jnp.ones(1), name="enc"),
}
MU = {"1/0/mu/layers/0/bias", "1/0/mu/layers/0/weight", "1/0/mu/scale"}
NU = {"1/0/nu/layers/0/bias", "1/0/nu/layers/0/weight", "1/0/nu/scale"}
LAYERS = {"1/0/mu/layers/0/bias", "1/0/mu/layers/0/weight",
          "1/0/nu/layers/0/bias", "1/0/nu/layers/0/weight"}
SIXTEEN = {"f32x4", "bf16x8", "c64x2", "bool16", "np"}
MOMENTS = pattern(".*/(mu|nu)/.*")
ADAM = optax.ScaleByAdamState(count=False, mu=True, nu=min_bytes(48))

SELECTIONS = [
    ("mixed", True, {"a", "b/0"}), ("mixed", False, set()),
    ("dtypes", _is_float, {"a", "d"}),
    # a prefix: bools, filters, callables at its leaves; a bool over a subtree
    ("nested", {"a": [False, True], "b": min_ndim(1), "c": lambda x: x.size == 1},
     {"a/1", "b/0", "c"}),
    ("nested", {"a": True, "b": False, "c": False}, {"a/0", "a/1"}),
    ("chain", (False, (ADAM, False)), MU | {"1/0/nu/layers/0/weight"}),
    ("model", {"encoder": Linear(True, False), "head": False}, {"encoder/weight"}),
    ("model", {"encoder": Linear(min_ndim(2), pattern("encoder/bias")), "head": True},
     {"encoder/weight", "encoder/bias", "head/weight"}),
    # `pattern` full-matches the whole path, also inside a prefix
    ("chain", pattern("1/0/mu/layers/0/weight"), {"1/0/mu/layers/0/weight"}),
    ("chain", pattern(".*/mu/.*"), MU),
    ("chain", pattern(".*(mu|nu)/layers/.*"), LAYERS),
    ("chain", pattern(".*"), MU | NU | {"1/0/count"}),
    ("scoped", {"opt": pattern("opt/mu"), "other": pattern("mu")}, {"opt/mu"}),
    ("pair", pattern("first/weight"), {"first/weight"}),
    ("pair", pattern("second/0"), {"second/0"}),
    # the size of the whole array, every dtype; `min_ndim`
    ("sizes", min_bytes(16), SIXTEEN), ("sizes", min_bytes(17), set()),
    ("sizes", min_bytes(14), SIXTEEN | {"f16x7"}),
    ("sizes", min_bytes(1), set(TREES["sizes"]()) - {"empty"}),
    ("sizes", min_bytes(0), set(TREES["sizes"]())),
    ("ndims", min_ndim(0), {"count", "v", "m"}),
    ("ndims", min_ndim(1), {"v", "m"}), ("ndims", min_ndim(2), {"m"}),
    # combinators
    ("chain", MOMENTS & min_ndim(1), LAYERS),
    ("chain", pattern(".*/mu/.*") | pattern(".*count"), MU | {"1/0/count"}),
    ("chain", ~MOMENTS, {"1/0/count"}), ("chain", ~(MOMENTS | min_ndim(0)), set()),
    ("chain", MOMENTS & ~pattern(".*/nu/.*") & min_bytes(48), {"1/0/mu/layers/0/weight"}),
]


def _on_host(tree: Any, where: Any) -> set[str]:
    """The paths `to_host(tree, where)` puts in host memory, the same eagerly and under jit."""
    eager = memory_kinds(eqx_offload.to_host(tree, where=where))
    traced = memory_kinds(eqx.filter_jit(lambda t: eqx_offload.to_host(t, where=where))(tree))
    on_host = {path for path, kind in eager.items() if kind == "pinned_host"}
    assert on_host == {path for path, kind in traced.items() if kind == "pinned_host"}
    assert set(traced.values()) <= {"pinned_host", "device"}  # (an unselected NumPy leaf)
    return on_host


@pytest.mark.parametrize("tree, where, expected", SELECTIONS)
def test_selects(tree: str, where: Any, expected: set[str]) -> None:
    assert _on_host(TREES[tree](), where) == expected


def test_paths_and_structure_divergence() -> None:
    """What `pattern` matches: optax states, modules and NamedTuples by field name; where a
    prefix first differs from the tree."""
    paths = [path_to_str(p) for p, _ in jtu.tree_flatten_with_path(_chain_state())[0]]
    assert paths == ["1/0/count", *sorted(MU), *sorted(NU)]
    assert list(memory_kinds(TREES["pair"]())) == ["first/weight", "first/bias", "second/0"]
    # A bare array has the empty path.
    assert leaf_mask(jnp.ones(2), pattern("")) == [True]
    assert leaf_mask(jnp.ones(2), pattern(".+")) == [False]
    tree = {"a": [jnp.ones(1), Pair(jnp.ones(1), None)]}
    is_true = lambda x: x is True  # noqa: E731
    assert structure_divergence({"a": [True, Pair(True, None)]}, tree, is_true) is None
    assert structure_divergence({"a": True}, tree, is_true) is None
    assert structure_divergence(tree, tree) is None
    assert structure_divergence({"a": [True, (True, None)]}, tree, is_true) == (
        "a/1", "tuple with 2 children where the tree has Pair with 2 children")


def test_masks_and_filter_values() -> None:
    """Only arrays are shown to callables and selected; any truthy result counts. Filters are
    hashable values that compose with callables into `Filter`s."""
    mixed, dtypes = TREES["mixed"](), TREES["dtypes"]()
    assert leaf_mask(mixed, True) == [True, True, False, False]
    assert leaf_mask(mixed, False) == [False] * 4
    seen: list[Any] = []
    assert leaf_mask(dtypes, lambda x: seen.append(x) or _is_float(x)) == [True, False, False, True]
    assert seen and all(eqx.is_array(x) for x in seen)
    assert leaf_mask(dtypes, lambda _: True) == [True, True, False, True]
    assert leaf_mask(dtypes, lambda x: np.bool_(x.ndim == 1)) == [True, False, False, True]
    assert leaf_mask(dtypes, lambda x: jnp.asarray(x.ndim == 0)) == [False, True, False, False]
    tree = {"a": None, "b": "name", "c": jnp.ones(2)}
    assert leaf_mask(tree, {"a": None, "b": True, "c": True}) == [False, True]
    assert leaf_mask(tree, {"a": True, "b": lambda _: True, "c": False}) == [False, False]

    def broken(x: Any) -> bool:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):  # a callable's error propagates
        eqx_offload.to_host({"a": jnp.ones(1)}, where=broken)
    assert pattern("a") == pattern("a") and hash(pattern("a")) == hash(pattern("a"))
    assert min_bytes(4) != min_bytes(5)
    assert len({min_ndim(1) & pattern("x"), min_ndim(1) & pattern("x")}) == 1
    tree = {"a": jnp.ones(3), "b": jnp.ones(3, jnp.int32), "c": jnp.ones(())}
    assert isinstance(min_ndim(1) & _is_float, Filter)
    for where, mask in [(min_ndim(1) & _is_float, [True, False, False]),
                        (_is_float & min_ndim(1), [True, False, False]),
                        (pattern("b") | _is_float, [True, True, True]),
                        (_is_float | pattern("b"), [True, True, True]),
                        (~(pattern("c") | _is_float), [False, True, False])]:
        assert leaf_mask(tree, where) == mask
    assert leaf_mask({"a": "text", "b": jnp.ones(1)}, ~pattern("b")) == [False, False]
    with pytest.raises(TypeError):
        min_ndim(1) & 3  # type: ignore[operator]  # not a filter: the error under test
    with pytest.raises(WhereError, match=re.escape("pattern(regex='(') is not a valid")):
        pattern("(")
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", None)))  # 128 bytes
    assert leaf_mask(x, min_bytes(128)) == [True] and leaf_mask(x, min_bytes(129)) == [False]


def test_specs_built_from_the_tree_and_pattern_fragments() -> None:
    """Specs built with `jax.tree.map` or `eqx.tree_at`; a path's fragment selects none, warned."""
    state = _chain_state()
    assert _on_host(state, jax.tree.map(lambda x: x.ndim >= 1, state)) == _on_host(
        state, min_ndim(1))
    model = TREES["model"]()
    spec = eqx.tree_at(lambda s: s["head"].weight, jax.tree.map(lambda _: False, model), True)
    assert _on_host(model, spec) == {"head/weight"}
    for fragment in ("mu", "mu/layers/0/weight"):
        with pytest.warns(eqx_offload.errors.OffloadWarning, match=r"pattern\("):
            assert _on_host(state, pattern(fragment)) == set()


@pytest.mark.parametrize("where, path", [
    ("mu", "<root>"), (3, "<root>"), (jnp.ones(3), "<root>"), ({"a": "yes", "b": True}, "a"),
    ({"a": True, "b": [True, 0]}, "b/1"), ({"a": jnp.ones(3), "b": True}, "a"),
])
def test_not_a_filter(where: Any, path: str) -> None:
    """Not a filter: a `WhereError` naming the path (or the annotation first)."""
    tree = TREES["errors"]()
    message = rf"where has .* at path {re.escape(path)}, which is not a filter"
    with pytest.raises(WhereError, match=message):
        leaf_mask(tree, where)
    with pytest.raises(WhereError, match=message):
        jax.jit(lambda t: leaf_mask(t, where) and t)(tree)
    for move in (eqx_offload.to_host, eqx_offload.to_device):
        with pytest.raises((TypeCheckError, WhereError), match="where"):
            move(tree, where=where)
    if not isinstance(where, dict):
        with pytest.raises(TypeCheckError, match="parameter 'where'"):
            eqx_offload.to_host({"a": jnp.ones(3)}, where=where)


MISMATCHES = [  # the tree, `where`, the path, what `where` has there, what the tree has
    ("errors", {"b": True}, "<root>", "dict with keys ['b']", "dict with keys ['a', 'b']"),
    ("errors", {"a": True, "b": [True]}, "b", "list with 1 children", "list with 2"),
    ("errors", {"a": True, "b": (True, True)}, "b", "tuple with 2 children", "list"),
    ("errors", {"a": True, "b": [True, {"x": True}]}, "b/1", "dict with keys ['x']",
     "array float32[]"),
    ("errors", {"a": None, "b": True}, "a", "None", "array float32[3]"),
    ("errors", [True, True], "<root>", "list with 2 children", "dict"),
    # a plain tuple where an optax state has a ScaleByAdamState; the params dict in mu
    ("chain", (True, ((False, True, True), True)), "1/0", "tuple with 3 children",
     "ScaleByAdamState"),
    ("chain", (True, (optax.ScaleByAdamState(count=False, mu={"layers": True}, nu=True), True)),
     "1/0/mu", "dict with keys ['layers']", "dict with keys ['layers', 'scale']"),
    # a module's static fields count
    ("linear", Linear(True, False), "<root>", "Linear with 2 children and static fields "
     "{'name': 'linear'}", "Linear with 2 children and static fields {'name': 'enc'}"),
    ("linear", {"weight": True, "bias": True}, "<root>", "dict with keys ['bias', 'weight']",
     "Linear"),
]


@pytest.mark.parametrize("tree, where, path, what, has", MISMATCHES)
def test_prefix_mismatch_names_the_path(tree: str, where: Any, path: str, what: str,
                                        has: str) -> None:
    """Both ways, eagerly and under jit; a `WhereError` is a `ValueError`."""
    tree = TREES[tree]()
    expected = (rf"not a prefix of the tree: at path {re.escape(path)} it has {re.escape(what)}"
                rf" where the tree has {re.escape(has)}")
    with pytest.raises(ValueError, match=expected) as info:
        eqx_offload.to_host(tree, where=where)
    assert isinstance(info.value, WhereError)
    with pytest.raises(WhereError, match=expected):
        eqx.filter_jit(lambda t: eqx_offload.to_device(t, where=where))(tree)

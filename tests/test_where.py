"""`where` filter specs: every form, the path-aware helpers, the combinators, the errors."""

import re
from typing import Any, NamedTuple

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
from eqx_offload import Filter, min_bytes, min_ndim, pattern, WhereError
from eqx_offload._leaves import path_to_str
from eqx_offload._where import leaf_mask, structure_divergence


class Pair(NamedTuple):
    first: Any
    second: Any


class Linear(eqx.Module):
    weight: Any
    bias: Any
    name: str = eqx.field(static=True, default="linear")


def _chain_state() -> Any:
    params = {"layers": [{"weight": jnp.ones((4, 3)), "bias": jnp.zeros(3)}],
              "scale": jnp.ones(())}
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)).init(params)


def _on_host(tree: Any, where: Any) -> set[str]:
    """The paths that `to_host(tree, where)` puts in host memory (eagerly), after checking
    that `jit` agrees."""
    eager = memory_kinds(eqx_offload.to_host(tree, where=where))
    traced = memory_kinds(eqx.filter_jit(lambda t: eqx_offload.to_host(t, where=where))(tree))
    on_host = {path for path, kind in eager.items() if kind == "pinned_host"}
    assert on_host == {path for path, kind in traced.items() if kind == "pinned_host"}
    # (Under jit an unselected NumPy leaf comes back as a device array.)
    assert set(traced.values()) <= {"pinned_host", "device"}
    return on_host


# --- paths ---------------------------------------------------------------------------------


def test_paths_of_an_optax_chain_state() -> None:
    paths = [path_to_str(p) for p, _ in jtu.tree_flatten_with_path(_chain_state())[0]]
    assert paths == [
        "1/0/count",
        "1/0/mu/layers/0/bias", "1/0/mu/layers/0/weight", "1/0/mu/scale",
        "1/0/nu/layers/0/bias", "1/0/nu/layers/0/weight", "1/0/nu/scale",
    ]


def test_paths_of_modules_and_namedtuples() -> None:
    tree = Pair(Linear(jnp.ones(2), jnp.ones(1)), {"k": [jnp.ones(1)]})
    paths = [path_to_str(p) for p, _ in jtu.tree_flatten_with_path(tree)[0]]
    assert paths == ["first/weight", "first/bias", "second/k/0"]


# --- bool and callable ---------------------------------------------------------------------


def test_bool() -> None:
    tree = {"a": jnp.ones(3), "b": [jnp.ones(()), "x", None, 2.0]}
    assert leaf_mask(tree, True) == [True, True, False, False]
    assert leaf_mask(tree, False) == [False, False, False, False]
    assert _on_host(tree, True) == {"a", "b/0"}
    assert _on_host(tree, False) == set()


def test_callable() -> None:
    tree = {"a": jnp.ones(3), "b": jnp.ones((), jnp.int32), "c": "text", "d": np.ones(2)}
    seen: list[Any] = []

    def is_float(x: Any) -> bool:
        seen.append(x)
        return jnp.issubdtype(x.dtype, jnp.floating)

    assert leaf_mask(tree, is_float) == [True, False, False, True]
    # Only arrays are shown to the callable; non-arrays are never selected.
    assert all(eqx.is_array(x) for x in seen)
    assert leaf_mask(tree, lambda _: True) == [True, True, False, True]
    # Any truthy result counts, including a NumPy / JAX boolean.
    assert leaf_mask(tree, lambda x: np.bool_(x.ndim == 1)) == [True, False, False, True]
    assert leaf_mask(tree, lambda x: jnp.asarray(x.ndim == 0)) == [False, True, False, False]
    assert _on_host(tree, is_float) == {"a", "d"}


def test_callable_errors_propagate() -> None:
    def broken(x: Any) -> bool:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        eqx_offload.to_host({"a": jnp.ones(1)}, where=broken)


# --- prefix pytrees ------------------------------------------------------------------------


def test_prefix_dict_list_tuple() -> None:
    tree = {"a": [jnp.ones(2), jnp.ones(3)], "b": (jnp.ones(4), jnp.ones(())), "c": jnp.ones(1)}
    where = {"a": [False, True], "b": min_ndim(1), "c": lambda x: x.size == 1}
    assert leaf_mask(tree, where) == [False, True, True, False, True]
    assert _on_host(tree, where) == {"a/1", "b/0", "c"}
    # A bool over a whole subtree.
    assert _on_host(tree, {"a": True, "b": False, "c": False}) == {"a/0", "a/1"}


def test_prefix_namedtuple_optax_state() -> None:
    state = _chain_state()
    adam = optax.ScaleByAdamState(count=False, mu=True, nu=min_bytes(48))
    where = (False, (adam, False))
    assert _on_host(state, where) == {
        "1/0/mu/layers/0/bias", "1/0/mu/layers/0/weight", "1/0/mu/scale",
        "1/0/nu/layers/0/weight",
    }
    # Built from the state itself, with `jax.tree.map`.
    full = jax.tree.map(lambda x: x.ndim >= 1, state)
    assert _on_host(state, full) == _on_host(state, min_ndim(1))


def test_prefix_module() -> None:
    model = {"encoder": Linear(jnp.ones((3, 2)), jnp.ones(2)), "head": Linear(jnp.ones(2), None)}
    where = {"encoder": Linear(True, False), "head": False}
    assert _on_host(model, where) == {"encoder/weight"}
    # A Module whose fields hold filters.
    where = {"encoder": Linear(min_ndim(2), pattern("encoder/bias")), "head": True}
    assert _on_host(model, where) == {"encoder/weight", "encoder/bias", "head/weight"}
    # The spec built from the model, as with Equinox.
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(lambda s: s["head"].weight, spec, True)
    assert _on_host(model, spec) == {"head/weight"}


def test_prefix_none_and_non_array_positions() -> None:
    tree = {"a": None, "b": "name", "c": jnp.ones(2)}
    # None stands where the tree has None; any filter may stand on a non-array leaf.
    assert leaf_mask(tree, {"a": None, "b": True, "c": True}) == [False, True]
    assert leaf_mask(tree, {"a": True, "b": lambda _: True, "c": False}) == [False, False]


# --- pattern -------------------------------------------------------------------------------


def test_pattern_full_match_on_chain_state() -> None:
    state = _chain_state()
    assert _on_host(state, pattern("1/0/mu/layers/0/weight")) == {"1/0/mu/layers/0/weight"}
    assert _on_host(state, pattern(".*/mu/.*")) == {
        "1/0/mu/layers/0/bias", "1/0/mu/layers/0/weight", "1/0/mu/scale"}
    assert _on_host(state, pattern(".*(mu|nu)/layers/.*")) == {
        "1/0/mu/layers/0/bias", "1/0/mu/layers/0/weight",
        "1/0/nu/layers/0/bias", "1/0/nu/layers/0/weight"}
    # Full match, not search: a fragment selects nothing, and `to_host` warns so.
    for fragment in ("mu", "mu/layers/0/weight"):
        with pytest.warns(eqx_offload.OffloadWarning, match=r"pattern\("):
            assert _on_host(state, pattern(fragment)) == set()
    assert _on_host(state, pattern(".*")) == set(memory_kinds(state))


def test_pattern_inside_prefix_sees_the_full_path() -> None:
    tree = {"opt": {"mu": jnp.ones(2), "nu": jnp.ones(2)}, "other": {"mu": jnp.ones(2)}}
    assert _on_host(tree, {"opt": pattern("opt/mu"), "other": pattern("mu")}) == {"opt/mu"}


def test_pattern_on_module_and_namedtuple_fields() -> None:
    tree = Pair(Linear(jnp.ones(2), jnp.ones(1)), [jnp.ones(1)])
    assert _on_host(tree, pattern("first/weight")) == {"first/weight"}
    assert _on_host(tree, pattern("second/0")) == {"second/0"}


def test_pattern_root_leaf() -> None:
    # A bare array has the empty path.
    assert leaf_mask(jnp.ones(2), pattern("")) == [True]
    assert leaf_mask(jnp.ones(2), pattern(".+")) == [False]


def test_pattern_invalid_regex() -> None:
    with pytest.raises(WhereError, match=re.escape("pattern(regex='(') is not a valid")):
        pattern("(")


# --- min_bytes / min_ndim ------------------------------------------------------------------


def test_min_bytes_boundaries() -> None:
    tree = {
        "f32x4": jnp.ones(4),  # 16 bytes
        "bf16x8": jnp.ones(8, jnp.bfloat16),  # 16 bytes
        "f16x7": jnp.ones(7, jnp.float16),  # 14 bytes
        "c64x2": jnp.ones(2, jnp.complex64),  # 16 bytes
        "bool16": jnp.ones(16, jnp.bool_),  # 16 bytes
        "count": jnp.zeros((), jnp.int32),  # 4 bytes
        "empty": jnp.ones((3, 0)),  # 0 bytes
        "np": np.ones(4, np.float32),  # 16 bytes
    }
    assert _on_host(tree, min_bytes(16)) == {"f32x4", "bf16x8", "c64x2", "bool16", "np"}
    assert _on_host(tree, min_bytes(17)) == set()
    assert _on_host(tree, min_bytes(14)) == {"f32x4", "bf16x8", "f16x7", "c64x2", "bool16", "np"}
    assert _on_host(tree, min_bytes(1)) == set(tree) - {"empty"}
    assert _on_host(tree, min_bytes(0)) == set(tree)


def test_min_bytes_counts_global_size_of_sharded_arrays() -> None:
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", None)))  # 128 bytes
    assert leaf_mask(x, min_bytes(128)) == [True]
    assert leaf_mask(x, min_bytes(129)) == [False]


def test_min_ndim() -> None:
    tree = {"count": jnp.zeros((), jnp.int32), "v": jnp.ones(3), "m": jnp.ones((2, 0)), "s": 1.0}
    assert _on_host(tree, min_ndim(0)) == {"count", "v", "m"}
    assert _on_host(tree, min_ndim(1)) == {"v", "m"}
    assert _on_host(tree, min_ndim(2)) == {"m"}


def test_filters_are_hashable_values() -> None:
    assert pattern("a") == pattern("a") and hash(pattern("a")) == hash(pattern("a"))
    assert min_bytes(4) != min_bytes(5)
    assert {min_ndim(1) & pattern("x"), min_ndim(1) & pattern("x")} == {min_ndim(1) & pattern("x")}


# --- combinators ---------------------------------------------------------------------------


def test_combinators() -> None:
    state = _chain_state()
    moments = pattern(".*/(mu|nu)/.*")
    assert _on_host(state, moments & min_ndim(1)) == {
        "1/0/mu/layers/0/bias", "1/0/mu/layers/0/weight",
        "1/0/nu/layers/0/bias", "1/0/nu/layers/0/weight"}
    assert _on_host(state, pattern(".*/mu/.*") | pattern(".*count")) == {
        "1/0/count", "1/0/mu/layers/0/bias", "1/0/mu/layers/0/weight", "1/0/mu/scale"}
    assert _on_host(state, ~moments) == {"1/0/count"}
    assert _on_host(state, ~(moments | min_ndim(0))) == set()
    assert _on_host(state, moments & ~pattern(".*/nu/.*") & min_bytes(48)) == {
        "1/0/mu/layers/0/weight"}
    # `~` never selects a non-array leaf.
    assert leaf_mask({"a": "text", "b": jnp.ones(1)}, ~pattern("b")) == [False, False]


def test_combinators_with_plain_callables() -> None:
    tree = {"a": jnp.ones(3), "b": jnp.ones(3, jnp.int32), "c": jnp.ones(())}

    def is_float(x: Any) -> bool:
        return jnp.issubdtype(x.dtype, jnp.floating)

    combined = min_ndim(1) & is_float
    assert isinstance(combined, Filter)
    assert leaf_mask(tree, combined) == [True, False, False]
    assert leaf_mask(tree, is_float & min_ndim(1)) == [True, False, False]
    assert leaf_mask(tree, pattern("b") | is_float) == [True, True, True]
    assert leaf_mask(tree, is_float | pattern("b")) == [True, True, True]
    assert leaf_mask(tree, ~(pattern("c") | is_float)) == [False, True, False]
    with pytest.raises(TypeError):
        min_ndim(1) & 3  # type: ignore[operator]  # not a filter: the test of the error


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where, path",
    [
        ("mu", "<root>"),
        (3, "<root>"),
        ({"a": "yes", "b": True}, "a"),
        ({"a": True, "b": [True, 0]}, "b/1"),
        ({"a": jnp.ones(3), "b": True}, "a"),
    ],
)
def test_not_a_filter(where: Any, path: str) -> None:
    tree = {"a": jnp.ones(3), "b": [jnp.ones(2), jnp.zeros(())]}
    # eqx_offload's own check (`leaf_mask` takes `where: Any`), what a user without
    # runtime type checking sees: it names the path.
    message = rf"where has .* at path {re.escape(path)}, which is not a filter"
    with pytest.raises(WhereError, match=message):
        leaf_mask(tree, where)
    with pytest.raises(WhereError, match=message):
        jax.jit(lambda t: leaf_mask(t, where) and t)(tree)
    # Under the pytest hook the `Where` annotation catches it first, down to the depth
    # it checks at runtime; below that, the same `WhereError`.
    for move in (eqx_offload.to_host, eqx_offload.to_device):
        with pytest.raises((TypeCheckError, WhereError), match="where"):
            move(tree, where=where)


@pytest.mark.parametrize("where", ["mu", 3, jnp.ones(3)])
def test_not_a_filter_under_runtime_type_checking(where: Any) -> None:
    with pytest.raises(TypeCheckError, match="parameter 'where'"):
        eqx_offload.to_host({"a": jnp.ones(3)}, where=where)


@pytest.mark.parametrize(
    "where, path, what",
    [
        ({"b": True}, "<root>", "dict with keys ['b'] where the tree has dict with keys ['a', 'b']"),
        ({"a": True, "b": [True]}, "b", "list with 1 children where the tree has list with 2"),
        ({"a": True, "b": (True, True)}, "b", "tuple with 2 children where the tree has list"),
        ({"a": True, "b": [True, {"x": True}]}, "b/1", "dict with keys ['x'] where the tree has "
         "array float32[]"),
        ({"a": None, "b": True}, "a", "None where the tree has array float32[3]"),
        ([True, True], "<root>", "list with 2 children where the tree has dict"),
    ],
)
def test_prefix_mismatch_names_the_path(where: Any, path: str, what: str) -> None:
    tree = {"a": jnp.ones(3), "b": [jnp.ones(2), jnp.zeros(())]}
    expected = rf"not a prefix of the tree: at path {re.escape(path)} it has {re.escape(what)}"
    with pytest.raises(WhereError, match=expected):
        eqx_offload.to_host(tree, where=where)
    with pytest.raises(WhereError, match=expected):
        eqx.filter_jit(lambda t: eqx_offload.to_device(t, where=where))(tree)


def test_prefix_mismatch_in_an_optax_state() -> None:
    state = _chain_state()
    # A plain tuple where the state has a ScaleByAdamState.
    with pytest.raises(WhereError, match=re.escape(
            "at path 1/0 it has tuple with 3 children where the tree has ScaleByAdamState")):
        eqx_offload.to_host(state, where=(True, ((False, True, True), True)))
    # Deeper: the params dict inside mu.
    adam = optax.ScaleByAdamState(count=False, mu={"layers": True}, nu=True)
    with pytest.raises(WhereError, match=re.escape(
            "at path 1/0/mu it has dict with keys ['layers'] where the tree has dict with keys "
            "['layers', 'scale']")):
        eqx_offload.to_host(state, where=(True, (adam, True)))


def test_prefix_mismatch_in_a_module() -> None:
    model = Linear(jnp.ones(2), jnp.ones(1), name="enc")
    with pytest.raises(WhereError, match=re.escape(
            "at path <root> it has Linear with 2 children and static fields {'name': 'linear'} "
            "where the tree has Linear with 2 children and static fields {'name': 'enc'}")):
        eqx_offload.to_host(model, where=Linear(True, False))
    with pytest.raises(WhereError, match=re.escape(
            "at path <root> it has dict with keys ['bias', 'weight'] where the tree has Linear")):
        eqx_offload.to_host(model, where={"weight": True, "bias": True})


def test_structure_divergence() -> None:
    tree = {"a": [jnp.ones(1), Pair(jnp.ones(1), None)]}
    assert structure_divergence({"a": [True, Pair(True, None)]}, tree, lambda x: x is True) is None
    assert structure_divergence({"a": True}, tree, lambda x: x is True) is None
    assert structure_divergence(tree, tree) is None
    found = structure_divergence({"a": [True, (True, None)]}, tree, lambda x: x is True)
    assert found == ("a/1", "tuple with 2 children where the tree has Pair with 2 children")


def test_where_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        eqx_offload.to_host({"a": jnp.ones(1)}, where={"b": True})

"""`to_host` / `to_device`: round trips, memory kinds, sharding, identity, one `device_put`."""

import contextlib
import inspect
import math
from typing import Any, NamedTuple, Optional

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import assert_tree_equal, memory_kinds, unchecked
from hypothesis import given, HealthCheck, Phase, settings
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import TypeCheckError

import eqx_offload
from eqx_offload import MemoryKindError, TracedMoveError, min_bytes, min_ndim


HOST_KINDS = ("pinned_host", "unpinned_host")
DTYPES = tuple(
    np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.bool_, jnp.complex64)
)
SHAPES = ((), (0,), (3,), (2, 0), (2, 3))
# Drawing an example puts arrays on devices: slow for Hypothesis' taste on a busy machine.
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Each example under jit compiles; shrinking a failure would take minutes, so report the
# failing example as found.
JIT_SETTINGS = settings(SETTINGS, max_examples=25,
                        phases=[Phase.explicit, Phase.reuse, Phase.generate])


class Pair(NamedTuple):
    first: Any
    second: Any


class Box(eqx.Module):
    x: Any
    y: Any
    tag: str = eqx.field(static=True, default="box")


# --- strategies -------------------------------------------------------------------------


@st.composite
def raw_arrays(draw: Any) -> np.ndarray:
    """A NumPy array of one of `DTYPES` / `SHAPES` filled with arbitrary bytes (NaN
    payloads, -0.0, subnormals: the round trip must keep every bit)."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from(SHAPES))
    size = math.prod(shape)
    raw = np.frombuffer(draw(st.binary(min_size=size * dtype.itemsize,
                                       max_size=size * dtype.itemsize)), np.uint8)
    if dtype == np.bool_:
        return (raw % 2).astype(np.bool_).reshape(shape)
    return raw.view(dtype).reshape(shape).copy()


@st.composite
def array_leaves(draw: Any) -> Any:
    """A JAX array on the device (most of the time), already in pinned host memory, or a
    NumPy array."""
    array = draw(raw_arrays())
    where = draw(st.sampled_from(["device", "device", "device", "pinned_host", "numpy"]))
    if where == "numpy":
        return array
    moved = jnp.asarray(array)
    if where == "pinned_host":
        moved = jax.device_put(moved, jax.memory.Space.Host)
    return moved


other_leaves = st.one_of(
    st.none(),
    st.integers(-3, 3),
    st.floats(allow_nan=False, width=32),
    st.booleans(),
    st.text(max_size=3),
)


@st.composite
def pytrees(draw: Any, depth: int = 0) -> Any:
    """A nested pytree of dicts, lists, tuples, NamedTuples and `eqx.Module`s (the root
    is always a container) with array leaves (two in three) and other leaves."""
    if depth > 0 and (depth >= 3 or draw(st.integers(0, 2)) == 0):
        return draw(st.one_of(array_leaves(), array_leaves(), other_leaves))
    kind = draw(st.sampled_from(["dict", "list", "tuple", "Pair", "Box"]))
    if kind == "Pair":
        return Pair(draw(pytrees(depth + 1)), draw(pytrees(depth + 1)))
    if kind == "Box":
        return Box(draw(pytrees(depth + 1)), draw(pytrees(depth + 1)),
                   draw(st.sampled_from(["box", "other"])))
    children = [draw(pytrees(depth + 1)) for _ in range(draw(st.integers(0, 4)))]
    if kind == "dict":
        return dict(zip("abcd", children))
    return children if kind == "list" else tuple(children)


def _children(node: Any) -> Optional[tuple[Any, list[Any]]]:
    """How to rebuild `node` and its children, or `None` for a leaf (of the generated
    trees only: dict, list, tuple, Pair, Box)."""
    if isinstance(node, dict):
        keys = list(node)
        return (lambda cs: dict(zip(keys, cs))), [node[k] for k in keys]
    if isinstance(node, Pair):
        return (lambda cs: Pair(*cs)), list(node)
    if isinstance(node, Box):
        return (lambda cs: Box(cs[0], cs[1], node.tag)), [node.x, node.y]
    if isinstance(node, list):
        return list, list(node)
    if isinstance(node, tuple):
        return tuple, list(node)
    return None


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


# Filters at a position of a `where` prefix, with an independent statement of what each
# selects (the prefix mechanics are what is under test).
SPEC_LEAVES: tuple[tuple[Any, Any], ...] = (
    (True, lambda x: True),
    (False, lambda x: False),
    (min_ndim(1), lambda x: x.ndim >= 1),
    (min_bytes(4), lambda x: x.size * x.dtype.itemsize >= 4),
    (_is_float, lambda x: jnp.issubdtype(x.dtype, jnp.floating)),
)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _nothing_to_move(tree: Any) -> Any:
    """A tree with leaves none of which is an array: moving it warns (`to_host([1, 2])`
    is almost surely meant to make arrays); otherwise nothing warns."""
    leaves = jtu.tree_leaves(tree)
    if leaves and not any(map(_is_array, leaves)):
        return pytest.warns(eqx_offload.OffloadWarning, match="nothing moved")
    return contextlib.nullcontext()


@st.composite
def spec_for(draw: Any, node: Any) -> tuple[Any, Any]:
    """A random `where` prefix of `node` and the tree of expected selections (a bool at
    every leaf of `node`)."""
    if node is None:
        return draw(st.sampled_from([None, True, False])), None
    children = _children(node)
    if children is None or draw(st.integers(0, 3)) == 0:
        spec, selects = draw(st.sampled_from(SPEC_LEAVES))
        expected = jtu.tree_map(lambda x: _is_array(x) and bool(selects(x)), node)
        return spec, expected
    rebuild, kids = children
    pairs = [draw(spec_for(kid)) for kid in kids]
    return rebuild([s for s, _ in pairs]), rebuild([e for _, e in pairs])


@st.composite
def cases(draw: Any) -> tuple[Any, Any, list[bool]]:
    tree = draw(pytrees())
    spec, expected = draw(spec_for(tree))
    return tree, spec, jtu.tree_leaves(expected)


# --- properties -------------------------------------------------------------------------


def _check_moved(tree: Any, out: Any, selected: list[bool], kind: str, *, eager: bool) -> None:
    leaves_in, def_in = jtu.tree_flatten(tree)
    leaves_out, def_out = jtu.tree_flatten(out)
    assert def_in == def_out
    assert len(selected) == len(leaves_in)
    for x, y, sel in zip(leaves_in, leaves_out, selected):
        if sel:
            assert isinstance(y, jax.Array)
            assert y.sharding.memory_kind == kind
            assert_tree_equal(y, x)
        elif eager:
            assert y is x
        else:
            assert_tree_equal(y, x)
            if isinstance(y, jax.Array):  # passed through the jitted function
                before = x.sharding.memory_kind if isinstance(x, jax.Array) else "device"
                assert y.sharding.memory_kind == before


@SETTINGS
@given(cases(), st.sampled_from(HOST_KINDS))
def test_round_trip_eager(case: Any, kind: str) -> None:
    tree, where, selected = case
    with _nothing_to_move(tree):
        _round_trip_eager(tree, where, selected, kind)


def _round_trip_eager(tree: Any, where: Any, selected: list[bool], kind: str) -> None:
    out = eqx_offload.to_host(tree, where=where, memory_kind=kind)
    _check_moved(tree, out, selected, kind, eager=True)
    # A selected leaf that was already in `kind` comes back as the same object.
    for x, y, sel in zip(jtu.tree_leaves(tree), jtu.tree_leaves(out), selected):
        if sel and isinstance(x, jax.Array) and x.sharding.memory_kind == kind:
            assert y is x
    back = eqx_offload.to_device(out)
    assert_tree_equal(back, tree)
    assert set(memory_kinds(back).values()) <= {"device"}
    # Non-array leaves are the very same objects.
    for x, y in zip(jtu.tree_leaves(tree), jtu.tree_leaves(back)):
        if not _is_array(x):
            assert y is x
    # `to_device` with the same `where` undoes exactly the selected moves.
    partial_back = eqx_offload.to_device(out, where=where)
    assert_tree_equal(partial_back, tree)
    for x, y, sel in zip(jtu.tree_leaves(tree), jtu.tree_leaves(partial_back), selected):
        if sel:
            assert y.sharding.memory_kind == "device"
        else:
            assert y is x


@JIT_SETTINGS
@given(cases())
def test_round_trip_jit(case: Any) -> None:
    tree, where, selected = case
    with _nothing_to_move(tree):
        _round_trip_jit(tree, where, selected)


def _round_trip_jit(tree: Any, where: Any, selected: list[bool]) -> None:
    out = eqx.filter_jit(lambda t: eqx_offload.to_host(t, where=where))(tree)
    _check_moved(tree, out, selected, "pinned_host", eager=False)
    back = eqx.filter_jit(lambda t: eqx_offload.to_device(t, where=where))(out)
    assert_tree_equal(back, tree)
    for x, y, sel in zip(jtu.tree_leaves(tree), jtu.tree_leaves(back), selected):
        if isinstance(y, jax.Array):
            unmoved = x.sharding.memory_kind if isinstance(x, jax.Array) else "device"
            assert y.sharding.memory_kind == ("device" if sel else unmoved)
    # Host -> device under jit, from an eagerly offloaded tree.
    host = eqx_offload.to_host(tree)
    # (A fresh function: `eqx.filter_jit` of one function would share its cache across
    # examples, and it matches static leaves by `==`, so `0` would come back for `0.0`.)
    back = eqx.filter_jit(lambda t: eqx_offload.to_device(t))(host)
    assert_tree_equal(back, tree)
    assert set(memory_kinds(back).values()) <= {"device"}


@JIT_SETTINGS
@given(cases())
def test_unpinned_host_under_jit_raises(case: Any) -> None:
    tree, where, selected = case
    run = eqx.filter_jit(lambda t: eqx_offload.to_host(t, where=where, memory_kind="unpinned_host"))
    if any(selected):
        with pytest.raises(TracedMoveError, match="unpinned_host.*pinned_host"):
            run(tree)
    else:
        with _nothing_to_move(tree):
            out = run(tree)
        _check_moved(tree, out, selected, "unpinned_host", eager=False)


def test_closed_over_constants_under_jit() -> None:
    """A concrete array closed over by a jitted function is moved inside the trace too;
    'unpinned_host', which JAX would silently drop there, raises."""
    x = jnp.arange(3.0)
    out = jax.jit(lambda: eqx_offload.to_host({"a": x, "n": np.ones(2, np.float32)}))()
    assert memory_kinds(out) == {"a": "pinned_host", "n": "pinned_host"}
    host = eqx_offload.to_host(x)
    assert jax.jit(lambda: eqx_offload.to_device(host))().sharding.memory_kind == "device"
    with pytest.raises(TracedMoveError, match="leaf a is inside a trace"):
        jax.jit(lambda: eqx_offload.to_host({"a": x}, memory_kind="unpinned_host"))()
    with pytest.raises(TracedMoveError, match="leaf <root> is inside a trace"):
        jax.jit(lambda: eqx_offload.to_host(np.ones(2), memory_kind="unpinned_host"))()


# --- every dtype and shape, explicitly -----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", HOST_KINDS)
def test_dtypes_and_shapes(dtype: np.dtype, shape: tuple[int, ...], kind: str) -> None:
    x = jnp.asarray(np.arange(math.prod(shape)).reshape(shape) % 2).astype(dtype)
    host = eqx_offload.to_host(x, memory_kind=kind)
    assert host.sharding.memory_kind == kind
    assert host.dtype == dtype and host.shape == shape
    back = eqx_offload.to_device(host)
    assert back.sharding.memory_kind == "device"
    assert_tree_equal(back, x)
    if kind == "pinned_host":
        traced = jax.jit(eqx_offload.to_host)(x)
        assert traced.sharding.memory_kind == "pinned_host"
        assert_tree_equal(traced, x)
        back = jax.jit(eqx_offload.to_device)(traced)
        assert back.sharding.memory_kind == "device"
        assert_tree_equal(back, x)


def test_optax_state_round_trip() -> None:
    params = {"layers": [{"weight": jnp.ones((3, 2)), "bias": jnp.zeros(2)}]}
    state = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)).init(params)
    host = eqx_offload.to_host(state)
    kinds = memory_kinds(host)
    assert kinds["1/0/mu/layers/0/weight"] == "pinned_host"
    assert kinds["1/0/count"] == "pinned_host"
    assert set(kinds.values()) == {"pinned_host"}
    assert type(host[1][0]) is optax.ScaleByAdamState
    assert_tree_equal(eqx_offload.to_device(host), state)


def test_unpinned_inputs_under_jit() -> None:
    x = jnp.arange(3.0)
    unpinned = eqx_offload.to_host(x, memory_kind="unpinned_host")
    back = jax.jit(eqx_offload.to_device)(unpinned)
    assert back.sharding.memory_kind == "device"
    pinned = jax.jit(eqx_offload.to_host)(unpinned)
    assert pinned.sharding.memory_kind == "pinned_host"
    assert_tree_equal(back, x)
    assert_tree_equal(pinned, x)


def test_typed_prng_keys() -> None:
    """Optimizer states may hold typed PRNG keys (an extended dtype, no NumPy dtype)."""
    key = jax.random.key(0)
    tree = {"key": key, "old_key": jax.random.PRNGKey(1)}
    for host in (eqx_offload.to_host(tree), jax.jit(eqx_offload.to_host)(tree)):
        assert memory_kinds(host) == {"key": "pinned_host", "old_key": "pinned_host"}
        assert host["key"].dtype == key.dtype
        back = eqx_offload.to_device(host)
        assert back["key"].dtype == key.dtype
        assert_tree_equal(jax.random.key_data(back["key"]), jax.random.key_data(key))
        assert_tree_equal(back["old_key"], tree["old_key"])
    # 8 bytes each (two uint32 words).
    assert memory_kinds(eqx_offload.to_host(tree, where=min_bytes(8))) == {
        "key": "pinned_host", "old_key": "pinned_host"}
    assert memory_kinds(eqx_offload.to_host(tree, where=min_bytes(9))) == {
        "key": "device", "old_key": "device"}


# --- non-array leaves, NumPy leaves -------------------------------------------------------


def test_non_array_leaves_untouched() -> None:
    marker = object()
    tree = {"f": 1.5, "i": 3, "b": True, "s": "text", "n": None, "o": marker,
            "fn": jnp.sin, "x": jnp.ones(2)}
    for where in (True, lambda _: True, jtu.tree_map(lambda _: True, tree)):
        out = eqx_offload.to_host(tree, where=where)
        for key in ("f", "i", "b", "s", "o", "fn"):
            assert out[key] is tree[key]
        assert out["n"] is None
        assert out["x"].sharding.memory_kind == "pinned_host"
        traced = eqx.filter_jit(lambda t: eqx_offload.to_host(t, where=where))(tree)
        for key in ("f", "i", "b", "s", "o", "fn"):
            assert traced[key] is tree[key]
        assert traced["x"].sharding.memory_kind == "pinned_host"


def test_numpy_leaves() -> None:
    """NumPy arrays are arrays (as for `eqx.is_array`): a selected one becomes a JAX array
    in the memory asked for, on the default device; an unselected one is left alone."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    scalar = np.int32(7)
    out = eqx_offload.to_host({"a": a, "s": scalar})
    for key, original in (("a", a), ("s", scalar)):
        assert isinstance(out[key], jax.Array)
        assert out[key].sharding.memory_kind == "pinned_host"
        assert out[key].devices() == {jax.devices()[0]}
        assert_tree_equal(out[key], original)
    kept = eqx_offload.to_host({"a": a}, where=False)
    assert kept["a"] is a
    on_device = eqx_offload.to_device({"a": a})
    assert on_device["a"].sharding.memory_kind == "device"
    assert_tree_equal(on_device["a"], a)
    with jax.default_device(jax.devices()[2]):
        moved = eqx_offload.to_host(a)
    assert moved.devices() == {jax.devices()[2]}


def test_leaf_on_another_device_stays_there() -> None:
    x = jax.device_put(jnp.arange(4.0), jax.devices()[5])
    host = eqx_offload.to_host(x)
    assert host.devices() == {jax.devices()[5]}
    assert host.sharding.memory_kind == "pinned_host"
    back = eqx_offload.to_device(host)
    assert back.devices() == {jax.devices()[5]}
    assert back.sharding.memory_kind == "device"


# --- sharded leaves ------------------------------------------------------------------------


@pytest.fixture
def sharded() -> jax.Array:
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    sharding = NamedSharding(mesh, P("data", None))
    return jax.device_put(jnp.arange(24.0).reshape(8, 3), sharding)


def _assert_same_layout(out: jax.Array, source: jax.Array, kind: str) -> None:
    assert isinstance(out.sharding, NamedSharding)
    assert out.sharding.mesh == source.sharding.mesh
    assert out.sharding.memory_kind == kind
    # Under jit the spec may come back without its trailing `None`s.
    assert out.sharding.is_equivalent_to(source.sharding.with_memory_kind(kind), out.ndim)
    spec = tuple(out.sharding.spec) + (None,) * (out.ndim - len(out.sharding.spec))
    assert spec == ("data", None)
    assert [s.device for s in out.addressable_shards] == [
        s.device for s in source.addressable_shards
    ]
    assert_tree_equal(out, source)


@pytest.mark.parametrize("kind", HOST_KINDS)
def test_sharded_eager(sharded: jax.Array, kind: str) -> None:
    host = eqx_offload.to_host({"w": sharded}, memory_kind=kind)["w"]
    assert host.sharding.spec == P("data", None)
    _assert_same_layout(host, sharded, kind)
    for shard in host.addressable_shards:
        assert shard.data.sharding.memory_kind == kind
    back = eqx_offload.to_device(host)
    assert back.sharding.spec == P("data", None)
    _assert_same_layout(back, sharded, "device")


def test_sharded_jit(sharded: jax.Array) -> None:
    host = jax.jit(eqx_offload.to_host)({"w": sharded})["w"]
    _assert_same_layout(host, sharded, "pinned_host")
    back = jax.jit(eqx_offload.to_device)(host)
    _assert_same_layout(back, sharded, "device")


# --- already in the target memory ----------------------------------------------------------


def test_already_on_target_is_not_copied() -> None:
    x = jnp.arange(5.0)
    host = eqx_offload.to_host(x)
    again = eqx_offload.to_host(host)
    assert again is host
    assert again.unsafe_buffer_pointer() == host.unsafe_buffer_pointer()
    assert eqx_offload.to_device(x) is x
    unpinned = eqx_offload.to_host(x, memory_kind="unpinned_host")
    assert eqx_offload.to_host(unpinned, memory_kind="unpinned_host") is unpinned
    # Pinned -> unpinned is a move, not a no-op.
    moved = eqx_offload.to_host(host, memory_kind="unpinned_host")
    assert moved.sharding.memory_kind == "unpinned_host"
    assert_tree_equal(moved, x)
    # Inside a tree, only the leaf that needs it is moved.
    tree = {"h": host, "d": x}
    out = eqx_offload.to_host(tree)
    assert out["h"] is host
    assert out["d"].sharding.memory_kind == "pinned_host"


def test_already_on_target_sharded(sharded: jax.Array) -> None:
    host = eqx_offload.to_host(sharded)
    again = eqx_offload.to_host(host)
    assert again is host
    assert [s.data.unsafe_buffer_pointer() for s in again.addressable_shards] == [
        s.data.unsafe_buffer_pointer() for s in host.addressable_shards
    ]


# --- one device_put for the selected part ---------------------------------------------------


@pytest.fixture
def device_put_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the `jax.device_put` calls and how many arrays each one moved."""
    calls: list[int] = []
    original = jax.device_put

    def counting(x: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(jtu.tree_leaves(x)))
        return original(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", counting)
    return calls


def _big_tree() -> dict[str, Any]:
    return {f"w{i}": jnp.full((2, i + 1), float(i)) for i in range(12)} | {
        "count": jnp.zeros((), jnp.int32), "name": "adam", "none": None}


def test_one_device_put_eager(device_put_calls: list[int]) -> None:
    tree = _big_tree()
    host = eqx_offload.to_host(tree)
    assert device_put_calls == [13]
    back = eqx_offload.to_device(host, where=min_ndim(1))
    assert device_put_calls == [13, 12]
    eqx_offload.to_host(host)  # everything is there already
    eqx_offload.to_host(tree, where=False)
    eqx_offload.to_device(tree)
    assert device_put_calls == [13, 12]
    assert back["count"] is host["count"]


def test_one_device_put_jit(device_put_calls: list[int]) -> None:
    tree = _big_tree()
    host = eqx.filter_jit(eqx_offload.to_host)(tree)
    assert device_put_calls == [13]
    eqx.filter_jit(eqx_offload.to_device)(host)
    assert device_put_calls == [13, 13]
    # Inputs already on the host: nothing to move inside the trace.
    same = eqx.filter_jit(lambda t: eqx_offload.to_host(t))(host)
    assert device_put_calls == [13, 13]
    assert set(memory_kinds(same).values()) == {"pinned_host"}


# --- memory-kind argument errors --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpu", "device", "host", None])
def test_bad_memory_kind(kind: Any) -> None:
    x = jnp.ones(2)
    # With runtime type checking on (the pytest hook), the `HostMemoryKind` literal
    # catches it first, naming the parameter.
    with pytest.raises(TypeCheckError, match="memory_kind"):
        eqx_offload.to_host(x, memory_kind=kind)
    # Without it, eqx_offload's own check.
    if kind == "device":
        message = r"memory_kind='device' is not a host memory kind.*to_device"
    else:
        message = rf"memory_kind={kind!r} is not a memory kind.*'pinned_host'"
    with pytest.raises(MemoryKindError, match=message):
        unchecked(eqx_offload.to_host)(x, memory_kind=kind)


def test_bad_memory_kind_is_checked_before_anything_moves(device_put_calls: list[int]) -> None:
    with pytest.raises(MemoryKindError):
        unchecked(eqx_offload.to_host)({"a": jnp.ones(2)}, memory_kind="gpu")
    with pytest.raises(MemoryKindError):
        unchecked(eqx_offload.to_host)({}, memory_kind="gpu")
    assert device_put_calls == []


def test_runtime_type_checking_is_on() -> None:
    """The pytest hook wraps the public functions (so the tests above see what a
    beartype user sees) and accepts every valid call."""
    assert inspect.unwrap(eqx_offload.to_host) is not eqx_offload.to_host
    assert inspect.unwrap(eqx_offload.to_device) is not eqx_offload.to_device
    x = jnp.ones(2)
    for kind in HOST_KINDS:
        assert eqx_offload.to_host(x, memory_kind=kind).sharding.memory_kind == kind


@pytest.mark.parametrize("make", [lambda: (x for x in [jnp.ones(3)]), lambda: iter([jnp.ones(3)]),
                                  lambda: map(jnp.asarray, [1.0])])
def test_iterator_is_not_a_tree(make: Any) -> None:
    """A generator (or any iterator) is one opaque leaf to JAX: a move would silently do
    nothing, so it is a `TreeError` (a `TypeError`) that says what to pass instead."""
    for move in (eqx_offload.to_host, eqx_offload.to_device):
        with pytest.raises(eqx_offload.TreeError, match="an iterator is not a pytree.*list"):
            unchecked(move)(make())
    assert issubclass(eqx_offload.TreeError, TypeError)

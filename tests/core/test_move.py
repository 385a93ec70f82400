"""`to_host` / `to_device`: round trips, memory kinds, sharding, identity, one `device_put`."""

import collections
import contextlib
import inspect
import math
from typing import Any

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import assert_tree_equal, memory_kinds, tree_equal, unchecked
from hypothesis import given, HealthCheck, Phase, settings
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import TypeCheckError

import eqx_offload
from eqx_offload import min_bytes, min_ndim, to_device, to_host
from eqx_offload.errors import MemoryKindError, TracedMoveError


HOST_KINDS = ("pinned_host", "unpinned_host")
DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32,
                                     jnp.bool_, jnp.complex64))
SHAPES = ((), (0,), (3,), (2, 0), (2, 3))
# Drawing puts arrays on devices (slow); under jit each example compiles: failures not shrunk.
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
JIT_SETTINGS = settings(SETTINGS, max_examples=25,
                        phases=[Phase.explicit, Phase.reuse, Phase.generate])


Pair = collections.namedtuple("Pair", "first second")


class Box(eqx.Module):
    x: Any
    y: Any
    tag: str = eqx.field(static=True, default="box")


def _kind(x: Any) -> str:
    return x.sharding.memory_kind if isinstance(x, jax.Array) else "device"


@st.composite
def array_leaves(draw: Any) -> Any:
    """Arbitrary bytes (NaN payloads, -0.0, subnormals) on the device, in host memory, or NumPy."""
    dtype, shape = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(SHAPES))
    n = math.prod(shape) * dtype.itemsize
    raw = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), np.uint8)
    array = ((raw % 2).astype(np.bool_) if dtype == np.bool_ else raw.view(dtype)).reshape(shape)
    where = draw(st.sampled_from(["device", "device", "device", "pinned_host", "numpy"]))
    if where == "numpy":
        return array.copy()
    return jax.device_put(jnp.asarray(array), jax.memory.Space.Host if where == "pinned_host"
                          else jax.memory.Space.Device)


def _containers(children: Any) -> Any:
    kids, keys = st.lists(children, max_size=4), st.sampled_from("abcd")
    return st.one_of(kids, kids.map(tuple), st.dictionaries(keys, children, max_size=4),
                     st.builds(Pair, children, children),
                     st.builds(Box, children, children, st.sampled_from(["box", "other"])))


# Nested containers (one at the root) with array leaves (two in three) and other leaves.
PYTREES = _containers(st.recursive(st.one_of(
    array_leaves(), array_leaves(), st.none(), st.integers(-3, 3),
    st.floats(allow_nan=False, width=32), st.booleans(), st.text(max_size=3)),
    _containers, max_leaves=8))


# Filters at a position of a `where` prefix, each with an independent statement of what
# it selects (the prefix mechanics are under test).
SPEC_LEAVES: tuple[tuple[Any, Any], ...] = (
    (True, lambda x: True),
    (False, lambda x: False),
    (min_ndim(1), lambda x: x.ndim >= 1),
    (min_bytes(4), lambda x: x.size * x.dtype.itemsize >= 4),
    (lambda x: jnp.issubdtype(x.dtype, jnp.floating),
     lambda x: jnp.issubdtype(x.dtype, jnp.floating)),
)


@st.composite
def spec_for(draw: Any, node: Any) -> tuple[Any, Any]:
    """A random `where` prefix of `node` and the expected selection at each of its leaves."""
    if node is None:
        return draw(st.sampled_from([None, True, False])), None
    kids, treedef = jtu.tree_flatten(node, is_leaf=lambda x: x is not node)
    if treedef == jtu.tree_structure(0) or draw(st.integers(0, 3)) == 0:
        spec, selects = draw(st.sampled_from(SPEC_LEAVES))
        return spec, jtu.tree_map(lambda x: eqx.is_array(x) and bool(selects(x)), node)
    pairs = [draw(spec_for(kid)) for kid in kids]
    return treedef.unflatten([s for s, _ in pairs]), treedef.unflatten([e for _, e in pairs])


@st.composite
def cases(draw: Any) -> tuple[Any, Any, list[bool]]:
    tree = draw(PYTREES)
    spec, expected = draw(spec_for(tree))
    return tree, spec, jtu.tree_leaves(expected)


def _nothing_to_move(tree: Any) -> Any:
    """`to_host([1, 2])` (leaves, none an array) warns; nothing else does."""
    leaves = jtu.tree_leaves(tree)
    if leaves and not any(map(eqx.is_array, leaves)):
        return pytest.warns(eqx_offload.errors.OffloadWarning, match="nothing moved")
    return contextlib.nullcontext()


def _check_moved(tree: Any, out: Any, selected: list[bool], kind: str, *, eager: bool) -> None:
    """Selected leaves bitwise in `kind`; eagerly others (or already there) the same objects."""
    assert jtu.tree_structure(tree) == jtu.tree_structure(out)
    leaves = jtu.tree_leaves(tree)
    assert len(selected) == len(leaves)
    for x, y, sel in zip(leaves, jtu.tree_leaves(out), selected):
        assert_tree_equal(y, x)
        if sel:
            assert isinstance(y, jax.Array) and y.sharding.memory_kind == kind
        if eager and (not sel or isinstance(x, jax.Array) and _kind(x) == kind):
            assert y is x  # not selected, or already in `kind`
        elif not sel and isinstance(y, jax.Array):
            assert y.sharding.memory_kind == _kind(x)


@SETTINGS
@given(cases(), st.sampled_from(HOST_KINDS))
def test_round_trip_eager(case: Any, kind: str) -> None:
    """Moves are bitwise both ways, non-arrays kept, `to_device(where)` undoes them."""
    tree, where, selected = case
    with _nothing_to_move(tree):
        out = to_host(tree, where=where, memory_kind=kind)
        _check_moved(tree, out, selected, kind, eager=True)
        back = to_device(out)
        assert_tree_equal(back, tree)
        assert set(memory_kinds(back).values()) <= {"device"}
        assert all(y is x for x, y in zip(jtu.tree_leaves(tree), jtu.tree_leaves(back))
                   if not eqx.is_array(x))
        partial = to_device(out, where=where)
        assert_tree_equal(partial, tree)
        for x, y, sel in zip(jtu.tree_leaves(tree), jtu.tree_leaves(partial), selected):
            assert (y.sharding.memory_kind == "device") if sel else (y is x)


@JIT_SETTINGS
@given(cases())
def test_round_trip_jit(case: Any) -> None:
    """The same under jit, where 'unpinned_host' raises (fresh lambdas: no shared cache)."""
    tree, where, selected = case
    unpinned = eqx.filter_jit(lambda t: to_host(t, where=where, memory_kind="unpinned_host"))
    with _nothing_to_move(tree):
        if any(selected):
            with pytest.raises(TracedMoveError, match="unpinned_host.*pinned_host"):
                unpinned(tree)
        else:
            _check_moved(tree, unpinned(tree), selected, "unpinned_host", eager=False)
        out = eqx.filter_jit(lambda t: to_host(t, where=where))(tree)
        _check_moved(tree, out, selected, "pinned_host", eager=False)
        back = eqx.filter_jit(lambda t: to_device(t, where=where))(out)
        assert_tree_equal(back, tree)
        for x, y, sel in zip(jtu.tree_leaves(tree), jtu.tree_leaves(back), selected):
            if isinstance(y, jax.Array):
                assert y.sharding.memory_kind == ("device" if sel else _kind(x))
        back = eqx.filter_jit(lambda t: to_device(t))(to_host(tree))
        assert_tree_equal(back, tree)
        assert set(memory_kinds(back).values()) <= {"device"}


def test_closed_over_constants_under_jit() -> None:
    """Closed-over arrays move in the trace; 'unpinned_host' there raises."""
    x = jnp.arange(3.0)
    out = jax.jit(lambda: to_host({"a": x, "n": np.ones(2, np.float32)}))()
    assert memory_kinds(out) == {"a": "pinned_host", "n": "pinned_host"}
    host = to_host(x)
    assert jax.jit(lambda: to_device(host))().sharding.memory_kind == "device"
    with pytest.raises(TracedMoveError, match="leaf a is inside a trace"):
        jax.jit(lambda: to_host({"a": x}, memory_kind="unpinned_host"))()
    with pytest.raises(TracedMoveError, match="leaf <root> is inside a trace"):
        jax.jit(lambda: to_host(np.ones(2), memory_kind="unpinned_host"))()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", HOST_KINDS)
def test_dtypes_and_shapes(dtype: np.dtype, shape: tuple[int, ...], kind: str) -> None:
    """Every dtype and shape round-trips bitwise, eagerly and under jit."""
    x = jnp.asarray(np.arange(math.prod(shape)).reshape(shape) % 2).astype(dtype)
    moves = [(lambda t: to_host(t, memory_kind=kind), to_device)]
    if kind == "pinned_host":
        moves.append((jax.jit(to_host), jax.jit(to_device)))
    for there, back in moves:
        host = there(x)
        assert (host.sharding.memory_kind, host.dtype, host.shape) == (kind, dtype, shape)
        assert_tree_equal(host, x)
        home = back(host)
        assert home.sharding.memory_kind == "device"
        assert_tree_equal(home, x)


def test_optax_state_and_unpinned_inputs() -> None:
    """An optax state moves whole; unpinned leaves are valid jit inputs."""
    params = {"layers": [{"weight": jnp.ones((3, 2)), "bias": jnp.zeros(2)}]}
    state = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)).init(params)
    host = to_host(state)
    assert set(memory_kinds(host).values()) == {"pinned_host"}
    assert len(memory_kinds(host)) == 5 and type(host[1][0]) is optax.ScaleByAdamState
    assert_tree_equal(to_device(host), state)
    x = jnp.arange(3.0)
    unpinned = to_host(x, memory_kind="unpinned_host")
    for move, kind in ((to_device, "device"), (to_host, "pinned_host")):
        out = jax.jit(move)(unpinned)
        assert out.sharding.memory_kind == kind
        assert_tree_equal(out, x)


def test_typed_prng_keys() -> None:
    """Typed and raw PRNG keys move; a key counts 8 bytes for `min_bytes`."""
    key = jax.random.key(0)
    tree = {"key": key, "old_key": jax.random.PRNGKey(1)}
    both_host = {"key": "pinned_host", "old_key": "pinned_host"}
    for host in (to_host(tree), jax.jit(to_host)(tree)):
        assert memory_kinds(host) == both_host and host["key"].dtype == key.dtype
        back = to_device(host)
        assert back["key"].dtype == key.dtype
        assert_tree_equal(jax.random.key_data(back["key"]), jax.random.key_data(key))
        assert_tree_equal(back["old_key"], tree["old_key"])
    assert memory_kinds(to_host(tree, where=min_bytes(8))) == both_host
    assert memory_kinds(to_host(tree, where=min_bytes(9))) == {"key": "device", "old_key": "device"}


def test_non_array_leaves_untouched() -> None:
    """Non-array leaves come back as the same objects, whatever `where` says."""
    tree = {"f": 1.5, "i": 3, "b": True, "s": "text", "n": None, "o": object(),
            "fn": jnp.sin, "x": jnp.ones(2)}
    for where in (True, lambda _: True, jtu.tree_map(lambda _: True, tree)):
        for out in (to_host(tree, where=where),
                    eqx.filter_jit(lambda t: to_host(t, where=where))(tree)):
            assert all(out[k] is tree[k] for k in ("f", "i", "b", "s", "o", "fn", "n"))
            assert out["x"].sharding.memory_kind == "pinned_host"


def test_numpy_leaves_and_devices() -> None:
    """Selected NumPy arrays move to the default device; others stay put."""
    a, scalar = np.arange(6, dtype=np.float32).reshape(2, 3), np.int32(7)
    out = to_host({"a": a, "s": scalar})
    for key, original in (("a", a), ("s", scalar)):
        assert isinstance(out[key], jax.Array) and out[key].devices() == {jax.devices()[0]}
        assert out[key].sharding.memory_kind == "pinned_host"
        assert_tree_equal(out[key], original)
    assert to_host({"a": a}, where=False)["a"] is a
    on_device = to_device({"a": a})["a"]
    assert on_device.sharding.memory_kind == "device" and tree_equal(on_device, a)
    with jax.default_device(jax.devices()[2]):
        assert to_host(a).devices() == {jax.devices()[2]}
    host = to_host(jax.device_put(jnp.arange(4.0), jax.devices()[5]))
    for out, kind in ((host, "pinned_host"), (to_device(host), "device")):
        assert (out.devices(), out.sharding.memory_kind) == ({jax.devices()[5]}, kind)


@pytest.mark.parametrize("kind, jit", [("pinned_host", False), ("unpinned_host", False),
                                       ("pinned_host", True)])
def test_sharded(kind: str, jit: bool) -> None:
    """A sharded leaf keeps mesh, spec and shard devices; moved again, it is not copied."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    x = jax.device_put(jnp.arange(24.0).reshape(8, 3), NamedSharding(mesh, P("data", None)))
    there, back = (jax.jit(to_host), jax.jit(to_device)) if jit else (
        lambda t: to_host(t, memory_kind=kind), to_device)
    host = there({"w": x})["w"]
    home = back(host)
    for out, want in ((host, kind), (home, "device")):
        assert isinstance(out.sharding, NamedSharding) and out.sharding.mesh == mesh
        assert out.sharding.memory_kind == want
        # (Under jit the spec may come back without its trailing `None`s.)
        assert out.sharding.is_equivalent_to(x.sharding.with_memory_kind(want), out.ndim)
        assert tuple(out.sharding.spec) + (None,) * (2 - len(out.sharding.spec)) == ("data", None)
        devices = [s.device for s in out.addressable_shards]
        assert devices == [s.device for s in x.addressable_shards]
        assert_tree_equal(out, x)
    if not jit:
        assert host.sharding.spec == home.sharding.spec == P("data", None)
        assert all(s.data.sharding.memory_kind == kind for s in host.addressable_shards)
        again = to_host(host, memory_kind=kind)
        assert again is host
        assert [s.data.unsafe_buffer_pointer() for s in again.addressable_shards] == [
            s.data.unsafe_buffer_pointer() for s in host.addressable_shards]


@pytest.fixture
def device_put_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many arrays each `jax.device_put` call moved."""
    calls: list[int] = []
    original = jax.device_put

    def counting(x: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(jtu.tree_leaves(x)))
        return original(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", counting)
    return calls


def test_one_device_put(device_put_calls: list[int]) -> None:
    """One `device_put` for the selected leaves, eagerly and under jit; none if none (a leaf
    already in the target memory is returned, not copied)."""
    tree = {f"w{i}": jnp.full((2, i + 1), float(i)) for i in range(12)} | {
        "count": jnp.zeros((), jnp.int32), "name": "adam", "none": None}
    host = to_host(tree)
    back = to_device(host, where=min_ndim(1))
    to_host(host)
    to_host(tree, where=False)
    to_device(tree)
    assert device_put_calls == [13, 12]
    assert back["count"] is host["count"]
    host = eqx.filter_jit(to_host)(tree)
    eqx.filter_jit(to_device)(host)
    same = eqx.filter_jit(lambda t: to_host(t))(host)
    assert device_put_calls == [13, 12, 13, 13]
    assert set(memory_kinds(same).values()) == {"pinned_host"}
    x = jnp.arange(5.0)
    host = to_host(x)
    again = to_host(host)
    assert again is host and again.unsafe_buffer_pointer() == host.unsafe_buffer_pointer()
    assert to_device(x) is x
    unpinned = to_host(x, memory_kind="unpinned_host")
    assert to_host(unpinned, memory_kind="unpinned_host") is unpinned
    moved = to_host(host, memory_kind="unpinned_host")  # pinned -> unpinned is a move
    assert moved.sharding.memory_kind == "unpinned_host" and tree_equal(moved, x)
    out = to_host({"h": host, "d": x})
    assert out["h"] is host and out["d"].sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("kind", ["gpu", "device", "host", None])
def test_bad_memory_kind(kind: Any, device_put_calls: list[int]) -> None:
    """The annotation (the pytest hook's) or eqx_offload's check rejects it before a move."""
    assert inspect.unwrap(to_host) is not to_host and inspect.unwrap(to_device) is not to_device
    x = jnp.ones(2)
    with pytest.raises(TypeCheckError, match="memory_kind"):
        to_host(x, memory_kind=kind)
    message = (r"memory_kind='device' is not a host memory kind.*to_device" if kind == "device"
               else rf"memory_kind={kind!r} is not a memory kind.*'pinned_host'")
    for tree in (x, {"a": x}, {}):
        with pytest.raises(MemoryKindError, match=message):
            unchecked(to_host)(tree, memory_kind=kind)
    assert device_put_calls == []


@pytest.mark.parametrize("make", [lambda: (x for x in [jnp.ones(3)]), lambda: iter([jnp.ones(3)]),
                                  lambda: map(jnp.asarray, [1.0])])
def test_iterator_is_not_a_tree(make: Any) -> None:
    """An iterator (one opaque leaf to JAX) is a `TreeError`, a `TypeError`."""
    assert issubclass(eqx_offload.errors.TreeError, TypeError)
    for move in (to_host, to_device):
        with pytest.raises(eqx_offload.errors.TreeError, match="an iterator is not a pytree.*list"):
            unchecked(move)(make())

"""`memory_report`: bytes per memory kind and per leaf path, eagerly and under jit."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_offload
from eqx_offload import memory_report, pattern
from eqx_offload.memory import LeafMemory, MemoryReport
from eqx_offload._core.leaves import format_bytes


def test_by_kind_totals_and_leaves() -> None:
    """Bytes per kind (NumPy in neither total) and one row per array leaf."""
    tree = {"mu": {"w": jnp.ones((64, 32)), "b": jnp.ones(32, jnp.bfloat16)},  # 8192 + 64 B
            "count": jnp.zeros((), jnp.int32), "np": np.ones(3, np.float32),  # 4 B, 12 B
            "name": "adam", "none": None, "lr": 1e-3,
            "unpinned": eqx_offload.to_host(jnp.ones(5, jnp.complex64),
                                            memory_kind="unpinned_host")}
    report = memory_report(eqx_offload.to_host(tree, where=pattern("mu/w")))
    assert isinstance(report, MemoryReport)
    assert report.by_kind == {"pinned_host": 8192, "device": 68, "numpy": 12, "unpinned_host": 40}
    assert (report.device_bytes, report.host_bytes, report.total_bytes) == (68, 8192 + 40, 8312)
    assert report.leaves == (
        LeafMemory("count", "device", 4, (), "int32"),
        LeafMemory("mu/b", "device", 64, (32,), "bfloat16"),
        LeafMemory("mu/w", "pinned_host", 8192, (64, 32), "float32"),
        LeafMemory("np", "numpy", 12, (3,), "float32"),
        LeafMemory("unpinned", "unpinned_host", 40, (5,), "complex64"))


def test_optax_state_paths() -> None:
    params = {"layers": [{"weight": jnp.ones((4, 4))}]}
    state = optax.chain(optax.clip(1.0), optax.adam(1e-3)).init(params)
    report = memory_report(eqx_offload.to_host(state, where=pattern(".*/(mu|nu)/.*")))
    assert [(leaf.path, leaf.memory_kind) for leaf in report.leaves] == [
        ("1/0/count", "device"), ("1/0/mu/layers/0/weight", "pinned_host"),
        ("1/0/nu/layers/0/weight", "pinned_host")]
    assert report.host_bytes == 2 * 64 and report.device_bytes == 4


def test_bare_array_empty_tree_and_sharded() -> None:
    """A bare array is `<root>`; an empty tree is 0 B; a sharded array counts its global size."""
    report = memory_report(jnp.ones(4))
    assert report.leaves == (LeafMemory("", "device", 16, (4,), "float32"),)
    assert "<root>" in str(report)
    empty = memory_report({"a": None, "b": "x"})
    assert empty.by_kind == {} and empty.leaves == () and "0 B" in str(empty)
    assert empty.device_bytes == empty.host_bytes == empty.total_bytes == 0
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data", None)))
    report = memory_report({"w": eqx_offload.to_host(x)})
    assert report.by_kind == {"pinned_host": 128} and report.leaves[0].shape == (8, 4)


def test_abstract_leaves_count_where_their_sharding_says() -> None:
    """Abstract leaves count under their sharding's kind, or as unplaced."""
    device = jax.sharding.make_single_device_sharding(jax.devices()[0])
    host = device.with_memory_kind("pinned_host")
    tree = {"abstract": jax.ShapeDtypeStruct((1024,), jnp.float32), "x": jnp.ones(2),
            "host": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=host),
            "on_device": jax.ShapeDtypeStruct((2,), jnp.int32, sharding=device),
            "text": "not an array"}
    report = memory_report(tree)
    assert [leaf.path for leaf in report.leaves] == ["abstract", "host", "on_device", "x"]
    assert report.by_kind == {"unplaced": 4096, "pinned_host": 16, "device": 16}
    assert (report.device_bytes, report.host_bytes, report.total_bytes) == (16, 16, 4128)
    params, opt = {"w": jnp.ones((8, 4))}, eqx_offload.offloaded(optax.adam(1e-3))
    abstract = eqx.filter_eval_shape(opt.init, params)
    assert memory_report(abstract).total_bytes == memory_report(opt.init(params)).total_bytes


def test_typed_prng_keys() -> None:
    """Keys count their key data (under jit sizes only: JAX 0.10 types them device)."""
    tree = {"key": eqx_offload.to_host(jax.random.key(0)),
            "keys": jax.random.split(jax.random.key(1), 4)}
    report = memory_report(tree)
    assert report.by_kind == {"pinned_host": 8, "device": 32}
    assert [leaf.dtype for leaf in report.leaves] == ["key<fry>", "key<fry>"]
    assert "key<fry>" in str(report)
    seen: list[MemoryReport] = []
    jax.jit(lambda t: seen.append(memory_report(t)) or t)(tree)
    assert seen[0].total_bytes == 40
    assert [leaf.dtype for leaf in seen[0].leaves] == ["key<fry>", "key<fry>"]


def test_str_is_a_table() -> None:
    tree = {"mu": jnp.ones((256, 256)), "count": jnp.zeros((), jnp.int32)}
    text = str(memory_report(eqx_offload.to_host(tree, where=pattern("mu"))))
    lines = text.splitlines()
    assert "memory report" in lines[0] and not text.endswith("\n")
    header = next(line for line in lines if "path" in line)
    assert all(c in header for c in ("path", "shape", "dtype", "memory kind", "bytes"))
    for path, cells in (("mu", ("[256, 256]", "float32", "pinned_host", "256.0 KiB")),
                        ("count", ("[]", "int32", "device", "4 B"))):
        row = next(line for line in lines if line.split()[:1] == [path])
        assert all(cell in row for cell in cells)
    total = next(line for line in lines if "total" in line)
    assert "device: 4 B" in total and "pinned_host: 256.0 KiB" in total


def test_under_jit() -> None:
    """Under jit the kind comes from each tracer's memory space."""
    seen: list[MemoryReport] = []

    @jax.jit
    def step(tree: Any) -> Any:
        moved = eqx_offload.to_host(tree, where=pattern("mu/.*"))
        seen.extend([memory_report(tree), memory_report(moved)])
        return moved

    out = step({"mu": {"w": jnp.ones((8, 8))}, "count": jnp.zeros((), jnp.int32)})
    before, after = seen
    assert before.by_kind == {"device": 256 + 4}
    assert after.by_kind == memory_report(out).by_kind == {"device": 4, "pinned_host": 256}
    assert [(leaf.path, leaf.memory_kind) for leaf in after.leaves] == [
        ("count", "device"), ("mu/w", "pinned_host")]
    seen.clear()
    jax.jit(lambda t: seen.append(memory_report(t)) or t)(out)
    assert seen[0].by_kind == {"device": 4, "pinned_host": 256}


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (4, "4 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (1 << 20, "1.0 MiB"), (5 << 30, "5.0 GiB"), (1 << 40, "1024.0 GiB")])
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_a_donated_state_is_reported_deleted_not_live() -> None:
    params = {"w": jnp.ones((2, 3))}
    opt = eqx_offload.offloaded(optax.adam(1e-3))
    old = opt.init(params)
    assert memory_report(old).host_bytes == 48
    eqx_offload.filter_jit(lambda s: s, donate="all")(old)
    report = memory_report(old)
    assert {leaf.memory_kind for leaf in report.leaves} == {"deleted"}
    assert report.host_bytes == report.device_bytes == 0 and report.host_pool_bytes == 0
    assert "deleted" in str(report)

"""Memory kinds the backend offers, the error for a kind a device lacks, the environment
variables that size the memory pools, and the pinned host pool's cap: checked by `init`
and the restores, shown by `memory_report`."""

import gc
import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import TypeCheckError

import eqx_offload
from eqx_offload._core import shape as _shape
from eqx_offload._plan import deviceless as _deviceless
from eqx_offload._core import memory as _memory
from eqx_offload import _report
from eqx_offload.errors import MemoryKindError


CPU_KINDS = ("device", "pinned_host", "unpinned_host")
GIB = 1 << 30


def test_supported_memory_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's kinds, each one a device really takes; a device, not a string; without one,
    the default device's."""
    assert eqx_offload.memory.supported_memory_kinds() == CPU_KINDS
    assert all(eqx_offload.memory.supported_memory_kinds(d) == CPU_KINDS for d in jax.devices())
    x = jnp.ones(2)
    for kind in CPU_KINDS:
        assert jax.device_put(x, x.sharding.with_memory_kind(kind)).sharding.memory_kind == kind
    with pytest.raises(TypeCheckError, match="device"):
        eqx_offload.memory.supported_memory_kinds("cpu:0")  # type: ignore[arg-type]  # under test
    asked: list[jax.Device] = []
    original = _memory.device_memory_kinds
    monkeypatch.setattr(_memory, "device_memory_kinds", lambda d: asked.append(d) or original(d))
    eqx_offload.memory.supported_memory_kinds()
    eqx_offload.memory.supported_memory_kinds(jax.devices()[6])
    with jax.default_device(jax.devices()[3]):
        eqx_offload.memory.supported_memory_kinds()
    with jax.default_device("cpu"):
        eqx_offload.memory.supported_memory_kinds()
    assert asked == [jax.devices()[i] for i in (0, 6, 3, 0)]


def _lacking(monkeypatch: pytest.MonkeyPatch, kind: str, only: Optional[set[Any]] = None) -> None:
    """Devices (all, or those in `only`) that lack `kind`."""
    original = _memory.device_memory_kinds
    monkeypatch.setattr(_memory, "device_memory_kinds", lambda device: tuple(
        k for k in original(device) if k != kind or (only is not None and device not in only)))


def test_unsupported_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The error names kind, device, platform, leaf (a NumPy leaf: on the default device) and
    the offer; a `ValueError`."""
    _lacking(monkeypatch, "unpinned_host")
    assert eqx_offload.memory.supported_memory_kinds() == ("device", "pinned_host")
    tree = {"state": {"mu": jnp.ones(3)}}
    message = ("memory_kind='unpinned_host': device cpu:0 (platform 'cpu') holding leaf state/mu "
               "does not offer that memory kind; it offers 'device', 'pinned_host'.")
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        eqx_offload.to_host(tree, memory_kind="unpinned_host")
    assert isinstance(info.value, MemoryKindError)
    assert eqx_offload.to_host(tree)["state"]["mu"].sharding.memory_kind == "pinned_host"
    monkeypatch.undo()
    _lacking(monkeypatch, "pinned_host")
    with jax.default_device(jax.devices()[1]), pytest.raises(MemoryKindError, match=re.escape(
            "memory_kind='pinned_host': device cpu:1 (platform 'cpu') holding leaf <root> "
            "does not offer that memory kind; it offers 'device', 'unpinned_host'.")):
        eqx_offload.to_host(np.ones(3, np.float32))


def test_unsupported_kind_on_one_device_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """One device lacking the kind is enough, and nothing moves."""
    devices = jax.devices()
    _lacking(monkeypatch, "pinned_host", only={devices[2], devices[7]})
    x = jax.device_put(jnp.ones((8, 2)), NamedSharding(Mesh(np.array(devices[:4]), ("data",)),
                                                       P("data", None)))
    with pytest.raises(MemoryKindError, match=r"device cpu:2 .* holding leaf w does not offer"):
        eqx_offload.to_host({"w": x})
    calls: list[Any] = []
    original_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or original_put(*a, **k))
    with pytest.raises(MemoryKindError, match="device cpu:7 .* holding leaf b"):
        eqx_offload.to_host({"a": jnp.ones(2), "b": original_put(jnp.ones(2), devices[7])})
    assert calls == []
    assert eqx_offload.to_host(original_put(jnp.ones(2), devices[1])).sharding.memory_kind == (
        "pinned_host")


@pytest.mark.parametrize("value, gigabytes", [
    (None, 64), ("", 64), ("192", 192), (" 8 ", 8), ("1.5", 64), ("abc", 64), ("+2", 64),
    ("1_0", 64), ("2e3", 64)])
def test_host_pool_limit_is_read_as_xla_reads_it(value: Optional[str], gigabytes: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An integer, spaces allowed, else 64 GiB; init and the planner agree."""
    variable = _memory.HOST_LIMIT_VARIABLE
    environ = {} if value is None else {variable: value}
    for platform, limit in [("cuda", gigabytes * GIB), ("gpu", gigabytes * GIB), ("cpu", None),
                            ("tpu", None)]:  # off CUDA/ROCm there is no such pool
        assert _memory.host_pool_limit(platform, environ) == limit
    monkeypatch.delenv(variable, raising=False)
    if value is not None:
        monkeypatch.setenv(variable, value)
    assert _deviceless.host_pool_limit_bytes() == gigabytes * GIB


def test_client_memory_fraction_is_read_as_jax_reads_it() -> None:
    read = _memory.client_memory_fraction
    assert read({}) == (0.75, "XLA's default")
    assert read({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}) == (0.75, "XLA's default")
    assert read({"XLA_CLIENT_MEM_FRACTION": ".9"}) == (0.9, "XLA_CLIENT_MEM_FRACTION")
    old = "XLA_PYTHON_CLIENT_MEM_FRACTION"
    assert read({old: "0.5"}) == (0.5, old)
    assert read({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})[0] == 1.0
    for bad in ("abc", "0", "1.5"):
        with pytest.raises(eqx_offload.errors.OptionError, match="XLA_CLIENT_MEM_FRACTION"):
            read({"XLA_CLIENT_MEM_FRACTION": bad})


@pytest.mark.parametrize("peak, fraction, host, expected", [
    (70, 0.9, 10, []),
    (70, 0.75, 10, ["XLA_CLIENT_MEM_FRACTION=0.88"]),
    (90, 0.75, 10, []),  # nothing helps
    (0, 0.75, 145, ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=145"]),
])
def test_run_settings(peak: int, fraction: float, host: int, expected: list[str]) -> None:
    """The settings to print for a run of an 80 GiB device with a 64 GiB host pool."""
    assert _memory.run_settings(max(peak * GIB, 1), 80 * GIB, fraction, host * GIB, 64 * GIB) == (
        expected)


def test_check_host_pool_fails_naming_the_variable() -> None:
    """Over the cap, the error names the variable; off CUDA/ROCm there is no such pool."""
    _memory.check_host_pool(4 * GIB, "gpu", "offloaded(...).init", in_use=60 * GIB, limit=64 * GIB)
    with pytest.raises(eqx_offload.errors.MemoryKindError) as info:
        _memory.check_host_pool(10 * GIB, "gpu", "offloaded(...).init", in_use=60 * GIB,
                                limit=64 * GIB)
    message = str(info.value)
    assert message.startswith("offloaded(...).init: placing 10.0 GiB in 'pinned_host'")
    assert "60.0 GiB already there" in message and "64.0 GiB cap" in message
    assert "export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=71" in message  # the fix
    _memory.check_host_pool(10**15, "cpu", "offloaded(...).init")
    report = eqx_offload.memory_report(eqx_offload.to_host({"w": jnp.ones(4)}))
    assert report.host_pool_limit is None and "pinned host pool" not in str(report)
    assert report.host_pool_bytes == 16


@pytest.fixture
def small_pool(monkeypatch: pytest.MonkeyPatch) -> int:
    """The CPU treated as a CUDA backend whose pinned host pool holds 64 KiB, counted from
    here on (what earlier tests left in `pinned_host` is not this test's)."""
    cap = 64 << 10
    for module in (_memory, _shape, _report):
        monkeypatch.setattr(module, "host_pool_limit", lambda platform, environ=None: cap)
    gc.collect()
    live, baseline = _memory.live_pooled_bytes, _memory.live_pooled_bytes("cpu")
    monkeypatch.setattr(_memory, "live_pooled_bytes", lambda platform: live(platform) - baseline)
    return cap


def test_init_and_restores_check_the_pool(small_pool: int) -> None:
    opt = eqx_offload.offloaded(optax.adam(1e-3))
    small = {"w": jnp.ones((32, 32))}  # 2 moments x 4 KiB: fits
    state = opt.init(small)
    big = {"w": jnp.ones((64, 128))}  # 2 moments x 32 KiB, with 8 KiB in use: does not
    before = {id(x) for x in jax.live_arrays()}
    with pytest.raises(eqx_offload.errors.MemoryKindError, match=r"offloaded\(\.\.\.\)\.init: placing "
                       r"64\.0 KiB .* with 8\.0 KiB already there"):
        opt.init(big)
    placed = [x for x in jax.live_arrays() if id(x) not in before]
    assert not [x for x in placed if x.sharding.memory_kind == "pinned_host"], placed
    with pytest.raises(eqx_offload.errors.MemoryKindError, match=r"abstract_init\(\.\.\.\): placing"):
        eqx_offload.checkpoint.abstract_init(opt, big)
    with pytest.raises(eqx_offload.errors.MemoryKindError, match=r"restore_target\(\.\.\.\): placing"):
        eqx_offload.checkpoint.restore_target(optax.adam(1e-3).init(big), eqx_offload.min_ndim(1))
    # `memory_report` shows the pool against its cap.
    report = eqx_offload.memory_report(state)
    assert report.host_pool_limit == small_pool and report.host_pool_bytes == 2 * 32 * 32 * 4
    assert str(report).splitlines()[-1] == (
        "pinned host pool: 8.0 KiB of the 64.0 KiB cap (12.5%; XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)")


def test_pool_bytes_count_each_devices_shard(small_pool: int) -> None:
    """A replicated leaf takes its full size on each device; a sharded one its shard."""
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    params = {"w": jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("x"))),
              "b": jax.device_put(jnp.ones(64), NamedSharding(mesh, P()))}
    report = eqx_offload.memory_report(eqx_offload.offloaded(optax.adam(1e-3)).init(params))
    assert report.host_pool_bytes == 2 * (64 * 64 * 4 + 4 * 64 * 4)

"""Memory kinds: what the backend offers, and the error for a kind a device lacks."""

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import TypeCheckError

import eqx_offload
import eqx_offload._memory
from eqx_offload import _deviceless
from eqx_offload import MemoryKindError


CPU_KINDS = ("device", "pinned_host", "unpinned_host")


def test_supported_memory_kinds_cpu() -> None:
    assert eqx_offload.supported_memory_kinds() == CPU_KINDS
    for device in jax.devices():
        assert eqx_offload.supported_memory_kinds(device) == CPU_KINDS
    # The kinds reported are the ones the device really takes.
    x = jnp.ones(2)
    for kind in CPU_KINDS:
        moved = jax.device_put(x, x.sharding.with_memory_kind(kind))
        assert moved.sharding.memory_kind == kind


def test_supported_memory_kinds_asks_the_default_device(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[jax.Device] = []
    original = eqx_offload._memory.device_memory_kinds

    def recording(device: jax.Device) -> tuple[str, ...]:
        asked.append(device)
        return original(device)

    monkeypatch.setattr(eqx_offload._memory, "device_memory_kinds", recording)
    eqx_offload.supported_memory_kinds()
    eqx_offload.supported_memory_kinds(jax.devices()[6])
    with jax.default_device(jax.devices()[3]):
        eqx_offload.supported_memory_kinds()
    with jax.default_device("cpu"):  # a platform name
        eqx_offload.supported_memory_kinds()
    assert asked == [jax.devices()[0], jax.devices()[6], jax.devices()[3], jax.devices()[0]]


def test_supported_memory_kinds_type_checked() -> None:
    with pytest.raises(TypeCheckError, match="device"):
        eqx_offload.supported_memory_kinds("cpu:0")  # type: ignore[arg-type]  # the error under test


# --- a device that lacks a kind -------------------------------------------------------------


def _without(kind: str, only: Any = None) -> Any:
    """A `device_memory_kinds` for devices that lack `kind` (all of them, or those in
    `only`)."""
    original = eqx_offload._memory.device_memory_kinds

    def kinds(device: jax.Device) -> tuple[str, ...]:
        offered = original(device)
        if only is None or device in only:
            return tuple(k for k in offered if k != kind)
        return offered

    return kinds


def test_unsupported_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eqx_offload._memory, "device_memory_kinds", _without("unpinned_host"))
    assert eqx_offload.supported_memory_kinds() == ("device", "pinned_host")
    tree = {"state": {"mu": jnp.ones(3)}}
    message = (
        "memory_kind='unpinned_host': device cpu:0 (platform 'cpu') holding leaf state/mu "
        "does not offer that memory kind; it offers 'device', 'pinned_host'."
    )
    with pytest.raises(MemoryKindError, match=re.escape(message)):
        eqx_offload.to_host(tree, memory_kind="unpinned_host")
    # The kinds it has still work.
    assert eqx_offload.to_host(tree)["state"]["mu"].sharding.memory_kind == "pinned_host"


def test_unsupported_kind_for_numpy_leaf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eqx_offload._memory, "device_memory_kinds", _without("pinned_host"))
    with jax.default_device(jax.devices()[1]):
        with pytest.raises(MemoryKindError, match=re.escape(
                "memory_kind='pinned_host': device cpu:1 (platform 'cpu') holding leaf <root> "
                "does not offer that memory kind; it offers 'device', 'unpinned_host'.")):
            eqx_offload.to_host(np.ones(3, np.float32))


def test_unsupported_kind_on_one_device_of_a_sharded_leaf(monkeypatch: pytest.MonkeyPatch) -> None:
    devices = jax.devices()[:4]
    monkeypatch.setattr(eqx_offload._memory, "device_memory_kinds",
                        _without("pinned_host", only={devices[2]}))
    mesh = Mesh(np.array(devices), ("data",))
    x = jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P("data", None)))
    with pytest.raises(MemoryKindError, match=r"device cpu:2 .* holding leaf w does not offer"):
        eqx_offload.to_host({"w": x})
    # A leaf on a device that has the kind is fine.
    y = jax.device_put(jnp.ones(2), devices[1])
    assert eqx_offload.to_host(y).sharding.memory_kind == "pinned_host"


def test_unsupported_kind_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every leaf is checked before the one `device_put`: an error leaves no half-moved
    tree behind (and no wasted transfer)."""
    tree = {"a": jnp.ones(2), "b": jax.device_put(jnp.ones(2), jax.devices()[7])}
    calls: list[Any] = []
    original_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or original_put(*a, **k))
    monkeypatch.setattr(eqx_offload._memory, "device_memory_kinds",
                        _without("pinned_host", only={jax.devices()[7]}))
    with pytest.raises(MemoryKindError, match="device cpu:7 .* holding leaf b"):
        eqx_offload.to_host(tree)
    assert calls == []


def test_memory_kind_errors_are_value_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eqx_offload._memory, "device_memory_kinds", _without("pinned_host"))
    with pytest.raises(ValueError):
        eqx_offload.to_host(jnp.ones(1))


def test_host_pool_limit_is_read_as_xla_reads_it(monkeypatch):
    # XLA reads `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` with `tsl::ReadInt64FromEnvVar`: an
    # integer (spaces around it allowed), else its default of 64 GiB. The planner's
    # `host_limit_bytes` and init's check read it the same way.
    gib = 1 << 30
    variable = eqx_offload._memory.HOST_LIMIT_VARIABLE
    for value, gigabytes in [(None, 64), ("", 64), ("192", 192), (" 8 ", 8), ("1.5", 64),
                             ("abc", 64), ("+2", 64), ("1_0", 64), ("2e3", 64)]:
        environ = {} if value is None else {variable: value}
        assert eqx_offload._memory.host_pool_limit("cuda", environ) == gigabytes * gib, value
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
        assert _deviceless.host_pool_limit_bytes() == gigabytes * gib, value


def test_client_memory_fraction_is_read_as_jax_reads_it():
    read = eqx_offload._memory.client_memory_fraction
    assert read({}) == (0.75, "XLA's default")
    assert read({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}) == (0.75, "XLA's default")
    assert read({"XLA_CLIENT_MEM_FRACTION": ".9"}) == (0.9, "XLA_CLIENT_MEM_FRACTION")
    assert read({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}) == (
        0.5, "XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert read({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})[0] == 1.0
    for bad in ("abc", "0", "1.5"):
        with pytest.raises(eqx_offload.OptionError, match="XLA_CLIENT_MEM_FRACTION"):
            read({"XLA_CLIENT_MEM_FRACTION": bad})


def test_run_settings():
    settings = eqx_offload._memory.run_settings
    gib = 1 << 30
    assert settings(70 * gib, 80 * gib, 0.9, 10 * gib, 64 * gib) == []
    assert settings(70 * gib, 80 * gib, 0.75, 10 * gib, 64 * gib) == [
        "XLA_CLIENT_MEM_FRACTION=0.88"]
    assert settings(90 * gib, 80 * gib, 0.75, 10 * gib, 64 * gib) == []  # nothing helps
    assert settings(1, 80 * gib, 0.75, 145 * gib, 64 * gib) == [
        "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=145"]

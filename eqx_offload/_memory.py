"""Which memory kinds a device offers, and the checks that name them in errors."""

from collections.abc import Iterable
from typing import Optional, get_args

import jax

from ._errors import MemoryKindError
from ._types import Device, HostMemoryKind, MemoryKind


KNOWN_MEMORY_KINDS: tuple[str, ...] = get_args(MemoryKind)
HOST_MEMORY_KINDS: tuple[str, ...] = get_args(HostMemoryKind)


def device_memory_kinds(device: Device) -> tuple[str, ...]:
    """The memory kinds `device` offers, in the order the backend lists them.

    (Tests replace this function to simulate a device that lacks a kind.)
    """
    return tuple(memory.kind for memory in device.addressable_memories())


def default_device() -> Device:
    """The device JAX places new arrays on (honours `jax.default_device`)."""
    configured = getattr(jax.config, "jax_default_device")  # an option, set dynamically
    if isinstance(configured, jax.Device):
        return configured
    if isinstance(configured, str):  # a platform name: `jax.default_device("cpu")`
        return jax.local_devices(backend=configured)[0]
    return jax.local_devices()[0]


def supported_memory_kinds(device: Optional[Device] = None) -> tuple[str, ...]:
    """The memory kinds a device offers.

    **Arguments:**

    - `device`: the device to ask; by default the device JAX places new arrays on.

    **Returns:**

    A tuple of memory-kind names, e.g. `("device", "pinned_host", "unpinned_host")` on
    the CPU backend and on most GPUs.

    !!! Example

        ```python
        import eqx_offload
        assert "pinned_host" in eqx_offload.supported_memory_kinds()
        ```
    """
    return device_memory_kinds(default_device() if device is None else device)


def check_kind_name(memory_kind: object, argument: str) -> None:
    """Raise a `MemoryKindError` unless `memory_kind` is a memory kind JAX knows."""
    if memory_kind not in KNOWN_MEMORY_KINDS:
        raise MemoryKindError(
            f"{argument}={memory_kind!r} is not a memory kind; use one of "
            f"{', '.join(repr(k) for k in KNOWN_MEMORY_KINDS)}."
        )


def check_host_kind(memory_kind: object, argument: str) -> None:
    """Raise a `MemoryKindError` unless `memory_kind` is a host memory kind."""
    check_kind_name(memory_kind, argument)
    if memory_kind not in HOST_MEMORY_KINDS:
        raise MemoryKindError(
            f"{argument}={memory_kind!r} is not a host memory kind; use one of "
            f"{', '.join(repr(k) for k in HOST_MEMORY_KINDS)} (to move to the device, "
            "use `eqx_offload.to_device`)."
        )


def check_devices_offer(
    devices: Iterable[Device], memory_kind: str, argument: str, path: str
) -> None:
    """Raise a `MemoryKindError` naming the device, the kind and the kinds available
    unless every device in `devices` offers `memory_kind`."""
    for device in devices:
        kinds = device_memory_kinds(device)
        if memory_kind not in kinds:
            raise MemoryKindError(
                f"{argument}={memory_kind!r}: device {device} (platform "
                f"{device.platform!r}) holding leaf {path or '<root>'} does not offer "
                f"that memory kind; it offers {', '.join(repr(k) for k in kinds)}. "
                "Pass one of those, or check `eqx_offload.supported_memory_kinds()`."
            )


def default_kind(device: Device) -> str:
    """The memory kind arrays land in on `device` when no kind is asked for."""
    return str(device.default_memory().kind)

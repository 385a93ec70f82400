"""Which memory kinds a device offers, and the checks that name them in errors."""

import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, Optional, get_args

import jax
import jax.numpy as jnp
import numpy as np

from .errors import MemoryKindError, OptionError
from .leaves import format_bytes
from .types import Device, HostMemoryKind, MemoryKind


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
        assert "pinned_host" in eqx_offload.memory.supported_memory_kinds()
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
                "Pass one of those, or check `eqx_offload.memory.supported_memory_kinds()`."
            )


# ----------------------------------------------------------------------------------------
# The pinned host pool of XLA's GPU client

HOST_LIMIT_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
"""XLA's GPU client allocates `pinned_host` memory from one pool per process, capped by
this environment variable (read when the client starts, as an integer number of GiB,
default 64: `GetGpuHostAllocator` in XLA's `xla/pjrt/gpu/gpu_helpers.cc`, which falls
back to 64 when the value is not an integer). A host allocation past the cap fails with
an out-of-memory error that reads like a device one."""

DEFAULT_HOST_LIMIT_GB = 64
_POOLED_PLATFORMS = ("gpu", "cuda", "rocm")  # JAX calls CUDA and ROCm devices "gpu"


def host_pool_limit(platform: str, environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The bytes of `pinned_host` memory XLA may allocate on `platform`, or `None` where
    no such cap applies (the CPU backend, TPUs)."""
    if platform.lower() not in _POOLED_PLATFORMS:
        return None
    value = (os.environ if environ is None else environ).get(HOST_LIMIT_VARIABLE)
    return _xla_int64(value, DEFAULT_HOST_LIMIT_GB) * (1 << 30)


def _xla_int64(value: Optional[str], default: int) -> int:
    """`value` read as XLA reads an integer environment variable (`tsl::
    ReadInt64FromEnvVar`, `safe_strto64`): an optional `-` and digits, spaces around
    them; `default` when unset or anything else ("1.5", "+2", "1_0", "abc": XLA logs an
    error and keeps its default)."""
    if value is None or not re.fullmatch(r"\s*-?[0-9]+\s*", value):
        return default
    return int(value)


def pooled_bytes(leaf: Any) -> int:
    """The `pinned_host` bytes `leaf` holds or will hold (a `jax.Array`, or a
    `jax.ShapeDtypeStruct` with a sharding) on this process's devices: one shard per
    addressable device (a replicated leaf counts once per device); 0 elsewhere."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding) or sharding.memory_kind != "pinned_host":
        return 0
    shard = sharding.shard_shape(tuple(leaf.shape))
    itemsize = _itemsize(leaf.dtype)
    return int(math.prod(shard)) * itemsize * len(sharding.addressable_devices)


def _itemsize(dtype: Any) -> int:
    """Bytes per element; for a typed PRNG key, those of its key data."""
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        shape = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype)).shape
        return int(math.prod(shape)) * 4  # key data is uint32
    itemsize: int = np.dtype(dtype).itemsize
    return itemsize


def live_pooled_bytes(platform: str) -> int:
    """The `pinned_host` bytes of the live arrays on `platform`'s devices."""
    total = 0
    for x in jax.live_arrays():
        try:
            if x.is_deleted() or next(iter(x.sharding.device_set)).platform != platform:
                continue
        except (RuntimeError, StopIteration):
            continue
        total += pooled_bytes(x)
    return total


def check_host_pool(
    placing: int, platform: str, what: str, *, in_use: Optional[int] = None,
    limit: Optional[int] = None,
) -> None:
    """Raise a `MemoryKindError` naming `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` if placing
    `placing` more bytes in `pinned_host` on `platform` would pass the pool's cap.

    `in_use`: bytes already there (default: the live arrays'); `limit`: the cap
    (default: `host_pool_limit(platform)`, `None` off CUDA/ROCm: nothing to check).
    Testable on the CPU by passing `platform="gpu"` and the two numbers."""
    cap = host_pool_limit(platform) if limit is None else limit
    if cap is None or placing <= 0:
        return
    used = live_pooled_bytes(platform) if in_use is None else in_use
    if used + placing <= cap:
        return
    raise MemoryKindError(
        f"{what}: placing {format_bytes(placing)} in 'pinned_host' memory, with {format_bytes(used)} "
        f"already there, passes the {format_bytes(cap)} cap of XLA's pinned host pool on "
        f"{platform!r} ({HOST_LIMIT_VARIABLE}="
        f"{os.environ.get(HOST_LIMIT_VARIABLE, f'{DEFAULT_HOST_LIMIT_GB} (default)')}). "
        f"XLA would fail with a host out-of-memory error that reads like a device one. "
        f"Raise the cap before JAX starts (e.g. `export {HOST_LIMIT_VARIABLE}="
        f"{math.ceil((used + placing) / (1 << 30)) + 1}`, within the machine's RAM), "
        "or offload less (`where=eqx_offload.stream.within_budget(...)`, `host_dtype=jnp.bfloat16`)."
    )


def platform_of(leaves: Iterable[Any]) -> str:
    """The platform of the first leaf with a sharding, else of the default device."""
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.Sharding):
            device: Any = next(iter(sharding.device_set))  # (`Device` is untyped for mypy)
            return str(device.platform)
    return str(default_device().platform)


def check_tree_fits_host_pool(leaves: Iterable[Any], what: str) -> None:
    """`check_host_pool` for the `pinned_host` leaves (arrays or `ShapeDtypeStruct`s) of
    something about to be placed; nothing to do (and nothing computed) off CUDA/ROCm."""
    leaves = list(leaves)
    platform = platform_of(leaves)
    if host_pool_limit(platform) is None:
        return
    check_host_pool(sum(map(pooled_bytes, leaves)), platform, what)


# ----------------------------------------------------------------------------------------
# The device memory JAX's GPU client allocates

MEM_FRACTION_VARIABLE = "XLA_CLIENT_MEM_FRACTION"
"""The variable that sets the fraction of a GPU's memory JAX's client allocates (read by
`jaxlib/xla_client.py`, JAX 0.10 to 0.12; `XLA_PYTHON_CLIENT_MEM_FRACTION` is its
deprecated name, read when it is not set, and an error together with it). Unset, XLA's
GPU client takes 0.75 (`GpuAllocatorConfig::memory_fraction`), with or without
`XLA_PYTHON_CLIENT_PREALLOCATE` (which decides when the memory is taken, not how much);
`XLA_PYTHON_CLIENT_ALLOCATOR=platform` allocates from the whole device on demand."""

_DEPRECATED_MEM_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEFAULT_MEM_FRACTION = 0.75


def client_memory_fraction(environ: Optional[Mapping[str, str]] = None) -> tuple[float, str]:
    """The fraction of each GPU's memory a JAX process started with `environ` (default:
    this one's) can allocate, and what set it: a variable's name, or `"XLA's default"`.
    A value JAX would refuse raises an `OptionError` naming the variable."""
    env = os.environ if environ is None else environ
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return 1.0, "XLA_PYTHON_CLIENT_ALLOCATOR=platform"
    for name in (MEM_FRACTION_VARIABLE, _DEPRECATED_MEM_FRACTION_VARIABLE):
        value = env.get(name, "")
        if value:
            try:
                fraction = float(value)
            except ValueError:
                fraction = -1.0
            if not 0.0 < fraction <= 1.0:
                raise OptionError(
                    f"Set {name} to a fraction in (0, 1] (JAX's GPU client reads it); it "
                    f"is {value!r}.")
            return fraction, name
    return DEFAULT_MEM_FRACTION, "XLA's default"


def run_settings(device_peak: int, device_memory: int, fraction: float, host_bytes: int,
                 host_limit: int) -> list[str]:
    """The environment a run of a planned step needs beyond `fraction` and `host_limit`:
    `XLA_CLIENT_MEM_FRACTION=...` where the device peak is above the fraction JAX
    allocates but within the device, `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=...` where the
    host bytes are above the pinned pool. Empty when none is needed (or none helps)."""
    settings = []
    if fraction * device_memory < device_peak <= device_memory:
        needed = math.ceil(100 * device_peak / device_memory) / 100
        settings.append(f"{MEM_FRACTION_VARIABLE}={min(needed, 1.0):.2f}")
    if host_bytes > host_limit:
        settings.append(f"{HOST_LIMIT_VARIABLE}={math.ceil(host_bytes / (1 << 30))}")
    return settings

"""Measuring: compilations (through `jax.monitoring`), timing statistics, XLA's memory
analysis, bitwise comparison and what the numbers were measured on."""

import dataclasses
import datetime
import importlib.metadata
import os
import platform
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional, Union

import equinox as eqx
import jax
import numpy as np


ACCELERATOR_RTOL = 1e-4
"""How closely an offloaded run's losses follow plain's on an accelerator, where XLA
compiles the forward and backward passes of two programs differently (on the CPU:
bitwise)."""


# --------------------------------------------------------------------------- compilations

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""The `jax.monitoring` event JAX records once per XLA compilation (the same name in
JAX 0.10 and 0.11: `jax._src.dispatch.BACKEND_COMPILE_EVENT`)."""

_TIMED_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    COMPILE_EVENT,
)
_active: list["CompileCounter"] = []
_lock = threading.Lock()
_registered = [False]


def _on_event(event: str, duration_secs: float, **kwargs: Union[str, int]) -> None:
    if event not in _TIMED_EVENTS:
        return
    with _lock:
        for counter in _active:
            counter.seconds += duration_secs
            if event == COMPILE_EVENT:
                counter.count += 1


@dataclasses.dataclass
class CompileCounter:
    """Backend compilations (XLA executables built) and the seconds spent tracing,
    lowering and compiling while the counter is active (see `counting`)."""

    count: int = 0
    seconds: float = 0.0


@contextmanager
def counting(counter: CompileCounter) -> Iterator[CompileCounter]:
    """Count the compilations JAX reports (via `jax.monitoring`) into `counter` while
    the block runs. Counters may be nested and reused."""
    if not _registered[0]:
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _registered[0] = True
    with _lock:
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)


# --------------------------------------------------------------------------- statistics

def summary(seconds: Sequence[float]) -> dict[str, Any]:
    """Median, quartiles and extremes of a list of timings (seconds), and the list."""
    xs = np.asarray(seconds, dtype=np.float64)
    return {
        "median": float(np.median(xs)),
        "p25": float(np.percentile(xs, 25)),
        "p75": float(np.percentile(xs, 75)),
        "min": float(np.min(xs)),
        "max": float(np.max(xs)),
        "n": int(xs.size),
        "all": [float(x) for x in xs],
    }


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """The ratio `a / b` of interleaved repetitions: median and quartiles of `a[i] / b[i]`."""
    r = np.asarray(a, dtype=np.float64) / np.asarray(b, dtype=np.float64)
    return {
        "median": float(np.median(r)),
        "p25": float(np.percentile(r, 25)),
        "p75": float(np.percentile(r, 75)),
    }


def memory_analysis_dict(compiled: Any) -> Optional[dict[str, int]]:
    """The `*_in_bytes` fields of `compiled.memory_analysis()` (None where the backend
    reports nothing)."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if stats is None:
        return None
    return {
        name: int(getattr(stats, name))
        for name in dir(stats)
        if name.endswith("_in_bytes") and isinstance(getattr(stats, name), int)
    }


# --------------------------------------------------------------------------- bitwise

def bitwise_equal(a: Any, b: Any) -> bool:
    """Whether two pytrees of arrays have the same structure and the same bits in every
    leaf (so `0.0` and `-0.0` differ and two identical NaNs are equal, unlike `==`)."""
    la, ta = jax.tree.flatten(eqx.filter(a, eqx.is_array))
    lb, tb = jax.tree.flatten(eqx.filter(b, eqx.is_array))
    # (Structures compared by their text, which names every node type and key.)
    if str(ta) != str(tb) or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return True


# --------------------------------------------------------------------------- machine

def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    device = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device": str(device),
        "device_count": jax.device_count(),
        "memory_kinds": [m.kind for m in device.addressable_memories()],
        "jax_version": jax.__version__,
        "jaxlib_version": _version("jaxlib"),
        "equinox_version": _version("equinox"),
        "optax_version": _version("optax"),
        "eqx_offload_version": _version("eqx_offload"),
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def load_average() -> Optional[float]:
    """The machine's 1-minute load average (other processes share it), if known."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None

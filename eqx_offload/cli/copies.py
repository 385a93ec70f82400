"""Bare copies between device and host memory: the transfer floor of one benchmark point
(the optimizer state's bytes, one direction at a time) and the eager movers' throughput
against NumPy copies of the same bytes."""

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any, Optional

import equinox as eqx
import jax
import numpy as np
import optax

import eqx_offload

from .measure import summary


MiB = 1 << 20


class StateCopy:
    """One bare copy of the optimizer state's offloaded leaves, in one direction.

    The leaves are those `offloaded(optimizer)` keeps in host memory by default
    (`where=eqx_offload.min_ndim(1)`). Each `run` copies them with one `jax.device_put`
    (host to device, or device to host) and waits for it: what the offloaded step must
    move each way, with nothing else in the program. It runs in the benchmark's
    interleaved rotation next to the modes, so both see the same machine."""

    def __init__(self, mode: str, source: list[jax.Array],
                 destination: list[jax.sharding.Sharding], nbytes: int) -> None:
        self.mode = mode
        self.source = source
        self.destination = destination
        self.nbytes = nbytes
        self.seconds: list[float] = []

    def run(self, batch: Any) -> tuple[float, float]:
        """One copy (`batch` unused); returns its wall-clock and process CPU seconds."""
        cpu = time.process_time()
        start = time.perf_counter()
        out = jax.device_put(self.source, self.destination)
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
        del out
        return elapsed, cpu


def state_copies(optimizer: optax.GradientTransformation, model: Any) -> list[StateCopy]:
    """`[to_device, to_host]` copies of the state that `optimizer` has for `model`."""
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    on_host = eqx_offload.to_host(state, where=eqx_offload.min_ndim(1))
    pairs = [
        (d, h) for d, h in zip(jax.tree.leaves(state), jax.tree.leaves(on_host))
        if isinstance(h, jax.Array) and h.sharding.memory_kind == "pinned_host"
    ]
    device = [d for d, _ in pairs]
    host = [h for _, h in pairs]
    nbytes = sum(d.nbytes for d in device)
    jax.block_until_ready((device, host))
    return [
        StateCopy("copy_to_device", host, [d.sharding for d in device], nbytes),
        StateCopy("copy_to_host", device, [h.sharding for h in host], nbytes),
    ]


def floor(copies: list[StateCopy], baseline: list[float]) -> dict[str, Any]:
    """The transfer floor of a point from the interleaved copy and baseline timings.

    - `one_way`: per repetition, the slower of the two directions.
    - `full_duplex`: per repetition, `max(baseline step, one_way)`: the best a step can
        do if both directions overlap each other and the compute.
    - `no_overlap`: `baseline step + one_way`: both directions overlap each other, but
        not the compute.
    - `serial`: `baseline step + to_device + to_host`: nothing overlaps (today's
        offloaded step, on an accelerator).
    """
    to_device, to_host = (np.asarray(c.seconds) for c in copies)
    base = np.asarray(baseline)
    one_way = np.maximum(to_device, to_host)
    return {
        "state_bytes": copies[0].nbytes,
        "to_device_seconds": summary(to_device.tolist()),
        "to_host_seconds": summary(to_host.tolist()),
        "to_device_gbps": _gbps(copies[0].nbytes, to_device),
        "to_host_gbps": _gbps(copies[0].nbytes, to_host),
        "one_way_seconds": summary(one_way.tolist()),
        "full_duplex_seconds": summary(np.maximum(base, one_way).tolist()),
        "no_overlap_seconds": summary((base + one_way).tolist()),
        "serial_seconds": summary((base + to_device + to_host).tolist()),
        # How compute-heavy the point is: > 1 means a perfect overlap can hide the copies.
        "baseline_over_one_way": float(np.median(base) / max(np.median(one_way), 1e-12)),
    }


def _gbps(nbytes: int, seconds: np.ndarray) -> Optional[float]:
    median = float(np.median(seconds))
    return nbytes / median / 1e9 if nbytes and median > 0 else None


# --------------------------------------------------------------------------- movers

def _hugepage_switch() -> Optional[Callable[[bool], Any]]:
    """NumPy's switch for `madvise(MADV_HUGEPAGE)` on large allocations, if it has one."""
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            mod = __import__(module, fromlist=["_set_madvise_hugepage"])
        except ImportError:
            continue
        switch = getattr(mod, "_set_madvise_hugepage", None)
        if switch is not None:
            return switch  # type: ignore[no-any-return]  # a NumPy builtin
    return None


def bench_movers(sizes_mib: tuple[int, ...], repeats: int,
                 tick: Callable[[], None]) -> list[dict[str, Any]]:
    """Eager `to_host` / `to_device` throughput against NumPy copies of the same bytes.

    Columns (GB/s = 1e9 bytes per second; `*_gbps` from the fastest of the interleaved
    repetitions, `*_gbps_median` from their median):

    - `to_host`, `to_device`: one float32 array of the size, moved by `eqx_offload`.
    - `to_host_8_leaves`: the same bytes as 8 leaves of a list (one `device_put`).
    - `numpy_copy`: `src.copy()` -- a fresh allocation plus memcpy, as a mover must do;
      NumPy asks the kernel for huge pages (`madvise`) for arrays of 4 MiB and more.
    - `numpy_copy_no_hugepages`: the same with NumPy's huge-page advice switched off.
    - `numpy_copyto`: `np.copyto(dst, src)` into a preallocated buffer: the bandwidth
      of the memcpy alone.
    """
    switch = _hugepage_switch()
    rows = []
    for mib in sizes_mib:
        n = mib * MiB // 4
        a = jax.device_put(np.arange(n, dtype=np.float32))
        parts = [jax.device_put(np.arange(n // 8, dtype=np.float32)) for _ in range(8)]
        h = eqx_offload.to_host(a)
        src = np.asarray(eqx_offload.to_host(a)).copy()
        dst = np.empty_like(src)
        jax.block_until_ready((a, parts, h))
        times: dict[str, list[float]] = {}

        def timed(name: str, fn: Callable[[], Any]) -> None:
            start = time.perf_counter()
            out = fn()
            jax.block_until_ready(out)
            times.setdefault(name, []).append(time.perf_counter() - start)
            del out

        def no_hugepages() -> Any:
            assert switch is not None
            previous = switch(False)
            try:
                return src.copy()
            finally:
                switch(bool(previous))

        cases: list[tuple[str, Callable[[], Any]]] = [
            ("to_host", lambda: eqx_offload.to_host(a)),
            ("to_device", lambda: eqx_offload.to_device(h)),
            ("to_host_8_leaves", lambda: eqx_offload.to_host(parts)),
            ("numpy_copy", lambda: src.copy()),
            ("numpy_copyto", lambda: np.copyto(dst, src)),
        ]
        if switch is not None:
            cases.append(("numpy_copy_no_hugepages", no_hugepages))
        for rep in range(repeats + 1):
            shift = rep % len(cases)
            for name, fn in cases[shift:] + cases[:shift]:
                timed(name, fn)
            tick()
        nbytes = n * 4
        row: dict[str, Any] = {"mib": mib, "bytes": nbytes}
        for name, ts in times.items():
            kept = ts[1:]  # the first repetition warms up
            # Best of the repetitions: interference from other processes only ever
            # adds time, so the fastest repetition is the best estimate of what the
            # operation itself costs. The median is kept too.
            row[name + "_gbps"] = nbytes / min(kept) / 1e9
            row[name + "_gbps_median"] = nbytes / statistics.median(kept) / 1e9
            row[name + "_seconds"] = summary(kept)
        rows.append(row)
        gc.collect()
    return rows

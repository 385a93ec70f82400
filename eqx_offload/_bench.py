"""`python -m eqx_offload bench`: step time, memory and mover throughput, side by side.

Three ways to run the same training step on the same model and data:

- `baseline`: no offload; `eqx.filter_jit(donate="all")` around the step.
- `manual`: the pattern of JAX's host-offloading tutorial: the whole optimizer state
  lives in `pinned_host`; inside a plain `jax.jit` the step `device_put`s it to the
  device, updates, and `device_put`s it back. The jit gets `in_shardings` and
  `out_shardings` that carry the memory kinds of every leaf, and donates params and
  state (`donate_argnums=(0, 1)`): with both shardings given, JAX pairs donated inputs
  only with outputs in the same memory. (Donating without them can abort the process;
  see the docs' "donation trap".)
- `eqx_offload`: `offloaded(optimizer)` and `eqx_offload.filter_jit(donate="all")`.

Repetitions are interleaved (one step of each mode in turn, in a rotating order) so
that a slow moment of a shared machine hits every mode alike; ratios to the baseline
are medians of per-repetition ratios.
"""

import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import equinox as eqx
import jax
import numpy as np
import optax

from ._demo import (
    bitwise_equal,
    CompileCounter,
    counting,
    make_data,
    make_model,
    make_step,
    num_params,
    OPTIMIZERS,
)
from ._jit import filter_jit
from ._move import to_device, to_host
from ._optax import offloaded
from ._report import format_bytes, memory_report
from ._stream import bench_transformation, BENCH_MODES


MODES = ("baseline", "manual", "eqx_offload") + BENCH_MODES
MiB = 1 << 20


# --------------------------------------------------------------------------- configuration

@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run measures."""

    sizes: tuple[float, ...]
    optimizers: tuple[str, ...] = ("adam", "adafactor")
    modes: tuple[str, ...] = MODES
    repeats: int = 13
    warmup: int = 2
    batch: int = 32
    mover_mib: tuple[int, ...] = (1, 4, 16, 64, 256)
    mover_repeats: int = 15
    target_min_params: float = 30e6
    is_quick: bool = False

    @staticmethod
    def full() -> "BenchConfig":
        return BenchConfig(sizes=(1e6, 3e6, 1e7, 3.2e7, 1e8))

    @staticmethod
    def quick() -> "BenchConfig":
        return BenchConfig(sizes=(2e4,), repeats=3, warmup=1, batch=8,
                           mover_mib=(1, 16), mover_repeats=3, is_quick=True)

    def replace(self, **changes: Any) -> "BenchConfig":
        return dataclasses.replace(self, **changes)


def shape_for(n: float) -> tuple[int, int]:
    """`(width, depth)` of a square MLP (`eqx.nn.MLP(width, width, width, depth)`) with
    about `n` parameters: `(depth + 1) * (width**2 + width)`; width a power of two up to
    4096, at least 4 layers where the size allows."""
    width = int(2 ** np.floor(np.log2(np.sqrt(max(n, 64) / 4))))
    width = max(8, min(width, 4096))
    layers = max(2, round(n / (width * width + width)))
    return width, layers - 1


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
        "jaxlib_version": getattr(jax.lib, "__version__", None) or _version("jaxlib"),
        "equinox_version": _version("equinox"),
        "optax_version": _version("optax"),
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _version(package: str) -> Optional[str]:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- statistics

def summary(seconds: Sequence[float]) -> dict[str, Any]:
    """Median, quartiles, extremes of a list of timings (seconds)."""
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


# --------------------------------------------------------------------------- the three modes

@dataclasses.dataclass
class Runner:
    """One mode of one configuration: its step, its live model and state."""

    mode: str
    step: Callable[..., Any]
    model: Any
    state: Any
    analyse: Callable[[Any, Any, Any, Any], Any]
    counter: CompileCounter = dataclasses.field(default_factory=CompileCounter)
    seconds: list[float] = dataclasses.field(default_factory=list)
    cpu_seconds: list[float] = dataclasses.field(default_factory=list)
    last_cpu: float = 0.0
    first_call: float = 0.0
    losses: list[Any] = dataclasses.field(default_factory=list)

    def run(self, x: Any, y: Any) -> float:
        with counting(self.counter):
            cpu = time.process_time()
            start = time.perf_counter()
            self.model, self.state, loss = self.step(self.model, self.state, x, y)
            jax.block_until_ready((self.model, self.state, loss))
            elapsed = time.perf_counter() - start
            self.last_cpu = time.process_time() - cpu
        self.losses.append(loss)
        return elapsed


def _baseline(optimizer: optax.GradientTransformation, model: Any) -> Runner:
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    # (Any: the stubs type `eqx.filter_jit`'s result as a plain callable, without `lower`.)
    step: Any = eqx.filter_jit(make_step(optimizer), donate="all")

    def analyse(model: Any, state: Any, x: Any, y: Any) -> Any:
        return step.lower(model, state, x, y).compile().compiled

    return Runner("baseline", step, model, state, analyse)


def _manual(optimizer: optax.GradientTransformation, model: Any) -> Runner:
    """JAX's tutorial pattern, on the array part of an Equinox model."""
    params, static = eqx.partition(model, eqx.is_array)
    device = jax.devices()[0]
    on_device = jax.sharding.SingleDeviceSharding(device)
    on_host = on_device.with_memory_kind("pinned_host")
    state = jax.device_put(optimizer.init(params), on_host)
    params = jax.device_put(params, on_device)
    inner = make_step(optimizer)

    def step(params: Any, state: Any, x: Any, y: Any) -> Any:
        state = jax.device_put(state, on_device)
        new_model, state, loss = inner(eqx.combine(params, static), state, x, y)
        state = jax.device_put(state, on_host)
        return eqx.filter(new_model, eqx.is_array), state, loss

    params_shardings = jax.tree.map(lambda _: on_device, params)
    state_shardings = jax.tree.map(lambda _: on_host, state)
    jitted = jax.jit(
        step,
        in_shardings=(params_shardings, state_shardings, on_device, on_device),
        out_shardings=(params_shardings, state_shardings, on_device),
        donate_argnums=(0, 1),
    )

    def analyse(params: Any, state: Any, x: Any, y: Any) -> Any:
        return jitted.lower(params, state, x, y).compile()

    return Runner("manual", jitted, params, state, analyse)


def _eqx_offload(optimizer: optax.GradientTransformation, model: Any) -> Runner:
    wrapped = offloaded(optimizer)
    state = wrapped.init(eqx.filter(model, eqx.is_array))
    step = filter_jit(make_step(wrapped), donate="all")

    def analyse(model: Any, state: Any, x: Any, y: Any) -> Any:
        executables = step._executables()  # type: ignore[attr-defined]  # filter_jit's introspection
        return executables[-1] if executables else None

    return Runner("eqx_offload", step, model, state, analyse)


def _bench_mode(mode: str) -> Callable[[optax.GradientTransformation, Any], Runner]:
    """`streamed` and `host_compute` (see `eqx_offload._stream.bench_transformation`),
    run like `eqx_offload`."""

    def make(optimizer: optax.GradientTransformation, model: Any) -> Runner:
        wrapped = bench_transformation(mode, optimizer)
        state = wrapped.init(eqx.filter(model, eqx.is_array))
        step = filter_jit(make_step(wrapped), donate="all")

        def analyse(model: Any, state: Any, x: Any, y: Any) -> Any:
            executables = step._executables()  # type: ignore[attr-defined]  # filter_jit's introspection
            return executables[-1] if executables else None

        return Runner(mode, step, model, state, analyse)

    return make


_MAKERS = {"baseline": _baseline, "manual": _manual, "eqx_offload": _eqx_offload,
           **{mode: _bench_mode(mode) for mode in BENCH_MODES}}


def _device_bytes_nonscalar(tree: Any) -> int:
    report = memory_report(tree)
    return sum(leaf.nbytes for leaf in report.leaves
               if leaf.memory_kind not in ("pinned_host", "unpinned_host") and leaf.shape)


def bench_point(
    optimizer_name: str, n: float, config: BenchConfig, tick: Callable[[], None]
) -> list[dict[str, Any]]:
    """Measure the modes of `config` on one (optimizer, size). The baseline always runs
    (the ratios are to it)."""
    width, depth = shape_for(n)
    xs, ys = make_data(width, config.batch, 1, seed=0)
    x, y = xs[0], ys[0]
    jax.block_until_ready((x, y))
    runners = []
    # A mode that fails (to build, compile or run) is reported with its error and the
    # others go on; the baseline must work, the ratios are to it.
    errors: dict[str, str] = {}
    for mode in ("baseline",) + tuple(m for m in MODES if m in config.modes and m != "baseline"):
        optimizer = OPTIMIZERS[optimizer_name](1e-3)
        try:
            runners.append(_MAKERS[mode](optimizer, make_model(width, depth, width, seed=0)))
        except Exception as e:  # noqa: BLE001 - reported in the results
            if mode == "baseline":
                raise
            errors[mode] = _describe_error(e)
    jax.block_until_ready([(r.model, r.state) for r in runners])
    count = num_params(runners[0].model)
    for rep in range(config.warmup + config.repeats):
        shift = rep % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            if runner.mode in errors:
                tick()
                continue
            try:
                elapsed = runner.run(x, y)
            except Exception as e:  # noqa: BLE001 - reported in the results
                if runner.mode == "baseline":
                    raise
                errors[runner.mode] = _describe_error(e)
                tick()
                continue
            if rep == 0:
                runner.first_call = elapsed
            elif rep >= config.warmup:
                runner.seconds.append(elapsed)
                runner.cpu_seconds.append(runner.last_cpu)
            tick()
    baseline = runners[0]
    results: list[dict[str, Any]] = [
        {"optimizer": optimizer_name, "target_params": n, "params": count, "width": width,
         "depth": depth, "batch": config.batch, "mode": mode, "error": error}
        for mode, error in errors.items()
    ]
    runners = [r for r in runners if r.mode not in errors]
    for runner in runners:
        compiled = runner.analyse(runner.model, runner.state, x, y)
        params_report = memory_report(runner.model)
        state_report = memory_report(runner.state)
        results.append({
            "optimizer": optimizer_name,
            "target_params": n,
            "params": count,
            "width": width,
            "depth": depth,
            "batch": config.batch,
            "mode": runner.mode,
            "error": None,
            "step_seconds": summary(runner.seconds),
            "ratio_to_baseline": paired_ratio(runner.seconds, baseline.seconds),
            # CPU time of this process (all its threads) per step: on the CPU backend,
            # the work a step does, whatever else the machine runs at the same time.
            "cpu_seconds": summary(runner.cpu_seconds),
            "cpu_ratio_to_baseline": paired_ratio(runner.cpu_seconds, baseline.cpu_seconds),
            "first_call_seconds": runner.first_call,
            "compile_seconds": runner.counter.seconds,
            "compilations": runner.counter.count,
            "params_device_bytes": params_report.device_bytes,
            "params_host_bytes": params_report.host_bytes,
            "opt_state_device_bytes": state_report.device_bytes,
            "opt_state_nonscalar_device_bytes": _device_bytes_nonscalar(runner.state),
            "opt_state_host_bytes": state_report.host_bytes,
            "opt_state_by_kind": state_report.by_kind,
            "memory_analysis": None if compiled is None else memory_analysis_dict(compiled),
            "losses_bitwise_equal_to_baseline": bitwise_equal(
                np.stack([np.asarray(v) for v in runner.losses]),
                np.stack([np.asarray(v) for v in baseline.losses]),
            ),
        })
    manual = [r for r in runners if r.mode == "manual"]
    for result, runner in zip(results[len(errors):], runners):
        result["ratio_to_manual"] = (
            paired_ratio(runner.seconds, manual[0].seconds) if manual else None)
    del runners, baseline, manual
    gc.collect()
    order = {mode: i for i, mode in enumerate(MODES)}
    return sorted(results, key=lambda r: order[r["mode"]])


def _describe_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".split("\n")[0][:500]


def measured(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points whose mode ran (not those that failed with an error)."""
    return [p for p in points if p.get("error") is None]


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


def bench_movers(config: BenchConfig, tick: Callable[[], None]) -> list[dict[str, Any]]:
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
    for mib in config.mover_mib:
        n = mib * MiB // 4
        a = jax.device_put(np.arange(n, dtype=np.float32))
        parts = [jax.device_put(np.arange(n // 8, dtype=np.float32)) for _ in range(8)]
        h = to_host(a)
        src = np.asarray(to_host(a)).copy()
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
            ("to_host", lambda: to_host(a)),
            ("to_device", lambda: to_device(h)),
            ("to_host_8_leaves", lambda: to_host(parts)),
            ("numpy_copy", lambda: src.copy()),
            ("numpy_copyto", lambda: np.copyto(dst, src)),
        ]
        if switch is not None:
            cases.append(("numpy_copy_no_hugepages", no_hugepages))
        for rep in range(config.mover_repeats + 1):
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
            row[name + "_seconds"] = summary(ts[1:])
        rows.append(row)
        gc.collect()
    return rows


# --------------------------------------------------------------------------- targets

def evaluate_targets(points: list[dict[str, Any]], movers: list[dict[str, Any]],
                     config: BenchConfig, backend: str) -> list[dict[str, Any]]:
    """Pass/fail per target, with the numbers behind each verdict."""
    targets: list[dict[str, Any]] = []
    failed = [p for p in points if p.get("error") is not None]
    points = measured(points)
    big = [p for p in points if p["params"] >= config.target_min_params]
    off = [p for p in points if p["mode"] == "eqx_offload"]
    big_off = [p for p in big if p["mode"] == "eqx_offload"]
    scope = "" if backend == "cpu" else f" (defined for the CPU backend; measured on {backend})"

    def add(name: str, ok: Optional[bool], detail: str) -> None:
        status = "n/a" if ok is None else ("pass" if ok else "FAIL")
        targets.append({"target": name, "status": status, "detail": detail})

    if big_off:
        worst = max(big_off, key=lambda p: p["ratio_to_baseline"]["median"])
        add(f"step time <= 1.05x baseline at >= {config.target_min_params / 1e6:.0f}M params"
            + scope,
            all(p["ratio_to_baseline"]["median"] <= 1.05 for p in big_off),
            "; ".join(f"{p['optimizer']} {p['params'] / 1e6:.1f}M: "
                      f"{p['ratio_to_baseline']['median']:.3f}x" for p in big_off)
            + f" (worst {worst['ratio_to_baseline']['median']:.3f}x)")
        verdicts = []
        for p in [p for p in big_off if p["ratio_to_manual"] is not None]:
            r = p["ratio_to_manual"]
            if r["median"] <= 1.0:
                verdicts.append(True)
            else:
                verdicts.append(r["p25"] <= 1.0)  # the manual pattern is within the noise
        add("step time <= manual pattern" + scope
            + " (pass: median ratio <= 1, or its interquartile range contains 1)",
            all(verdicts) if verdicts else None,
            "; ".join(f"{p['optimizer']} {p['params'] / 1e6:.1f}M: "
                      f"{p['ratio_to_manual']['median']:.3f}x "
                      f"[{p['ratio_to_manual']['p25']:.3f}, {p['ratio_to_manual']['p75']:.3f}]"
                      for p in big_off if p["ratio_to_manual"] is not None))
    else:
        add(f"step time at >= {config.target_min_params / 1e6:.0f}M params", None,
            "no configuration that large in this run")
    add("optimizer state: 0 device bytes between steps (arrays of >= 1 dimension)",
        all(p["opt_state_nonscalar_device_bytes"] == 0 for p in off),
        "; ".join(sorted({f"{p['optimizer']}: {p['opt_state_nonscalar_device_bytes']} B of "
                          f"arrays, {p['opt_state_device_bytes']} B in all (0-d step "
                          "counters stay on the device by default)" for p in off})))
    add("exactly one compilation per configuration (eqx_offload)",
        all(p["compilations"] == 1 for p in off),
        ", ".join(sorted({str(p["compilations"]) for p in off})) + " compilation(s); "
        "baseline: " + ", ".join(sorted({str(p["compilations"]) for p in points
                                         if p["mode"] == "baseline"}))
        + "; manual: " + ", ".join(sorted({str(p["compilations"]) for p in points
                                          if p["mode"] == "manual"})))
    add("losses bitwise equal to the baseline (all modes)",
        all(p["losses_bitwise_equal_to_baseline"] for p in points), "")
    add("every mode ran", not failed,
        "; ".join(f"{p['mode']} ({p['optimizer']} {p['params'] / 1e6:.1f}M): {p['error']}"
                  for p in failed))
    large = [m for m in movers if m["mib"] >= 16]
    if large:
        details = []
        ok = True
        for m in large:
            frac = min(m["to_host_gbps"], m["to_device_gbps"]) / m["numpy_copy_gbps"]
            ok = ok and frac >= 0.5
            extra = ""
            if "numpy_copy_no_hugepages_gbps" in m:
                extra = (f", {min(m['to_host_gbps'], m['to_device_gbps']) / m['numpy_copy_no_hugepages_gbps']:.0%}"
                         " of a copy without huge pages")
            details.append(f"{m['mib']} MiB: to_host {m['to_host_gbps']:.2f}, to_device "
                           f"{m['to_device_gbps']:.2f}, numpy {m['numpy_copy_gbps']:.2f} GB/s "
                           f"= {frac:.0%}{extra}")
        add("eager movers >= 50% of NumPy copy bandwidth (arrays >= 16 MiB; best of "
            f"{config.mover_repeats} interleaved repetitions each)", ok,
            "; ".join(details))
    else:
        add("eager movers >= 50% of NumPy copy bandwidth (arrays >= 16 MiB)", None,
            "no array that large in this run")
    return targets


# --------------------------------------------------------------------------- reports

def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def markdown(result: dict[str, Any]) -> str:
    """The results as Markdown tables (for the README and the docs)."""
    m = result["machine"]
    lines = [
        f"Measured {m['date']} on **{m['device_kind']}** (backend `{m['backend']}`, "
        f"{m['cpu_count']} CPU cores: {m['cpu']}), JAX {m['jax_version']}, "
        f"batch {result['config']['batch']}, {result['config']['repeats']} interleaved "
        "repetitions per point; load average (1 min) "
        f"{m.get('load_average_start')} at the start, {m.get('load_average_end')} at the end.",
        "",
        "| optimizer | params | mode | step ms (median [p25, p75]) | × baseline | "
        "× baseline, process CPU time | device bytes: params + opt state | "
        "opt state on host | compilations | compile s | temp / peak (memory_analysis) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in result["points"]:
        if p.get("error") is not None:
            lines.append(f"| {p['optimizer']} | {p['params'] / 1e6:.1f}M | {p['mode']} | "
                         f"failed: {p['error'].replace('|', '/')} | | | | | | | |")
            continue
        s = p["step_seconds"]
        ma = p["memory_analysis"] or {}
        temp = ma.get("temp_size_in_bytes")
        peak = ma.get("peak_memory_in_bytes")
        mem = (f"{format_bytes(temp) if temp is not None else '–'} / "
               f"{format_bytes(peak) if peak is not None else '–'}")
        lines.append(
            f"| {p['optimizer']} | {p['params'] / 1e6:.1f}M | {p['mode']} | "
            f"{_ms(s['median'])} [{_ms(s['p25'])}, {_ms(s['p75'])}] | "
            f"{p['ratio_to_baseline']['median']:.3f} | "
            f"{p['cpu_ratio_to_baseline']['median']:.3f} | "
            f"{format_bytes(p['params_device_bytes'] + p['opt_state_device_bytes'])} | "
            f"{format_bytes(p['opt_state_host_bytes'])} | {p['compilations']} | "
            f"{p['compile_seconds']:.2f} | {mem} |")
    if result["movers"]:
        lines += [
            "",
            f"Eager movers, GB/s (best of {result['config']['mover_repeats']} interleaved "
            "repetitions):",
            "",
            "| array | to_host | to_device | to_host, 8 leaves | NumPy copy | "
            "NumPy copy, no huge pages | NumPy copyto (preallocated) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for mv in result["movers"]:
            def g(key: str) -> str:
                v = mv.get(key + "_gbps")
                return "–" if v is None else f"{v:.2f}"
            lines.append(f"| {mv['mib']} MiB | {g('to_host')} | {g('to_device')} | "
                         f"{g('to_host_8_leaves')} | {g('numpy_copy')} | "
                         f"{g('numpy_copy_no_hugepages')} | {g('numpy_copyto')} |")
    lines += ["", "| target | result | numbers |", "| --- | --- | --- |"]
    for t in result["targets"]:
        lines.append(f"| {t['target']} | **{t['status']}** | {t['detail']} |")
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any], out: str) -> list[str]:
    """PNG plots: step-time ratio vs size, device bytes vs size, movers vs copy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["machine"]
    subtitle = f"{m['device_kind']} ({m['backend']}), JAX {m['jax_version']}"
    styles = {"adam": "-", "adafactor": "--"}
    colors = {"baseline": "tab:gray", "manual": "tab:orange", "eqx_offload": "tab:blue",
              "streamed": "tab:green", "host_compute": "tab:purple"}
    written = []
    points = measured(result["points"])
    optimizers = sorted({p["optimizer"] for p in points})
    present = {p["mode"] for p in points}

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for opt in optimizers:
        for mode in [m for m in MODES if m != "baseline" and m in present]:
            ps = sorted((p for p in points if p["optimizer"] == opt and p["mode"] == mode),
                        key=lambda p: p["params"])
            xs = [p["params"] for p in ps]
            med = [p["ratio_to_baseline"]["median"] for p in ps]
            lo = [p["ratio_to_baseline"]["median"] - p["ratio_to_baseline"]["p25"] for p in ps]
            hi = [p["ratio_to_baseline"]["p75"] - p["ratio_to_baseline"]["median"] for p in ps]
            ax.errorbar(xs, med, yerr=[lo, hi], linestyle=styles.get(opt, ":"), marker="o",
                        color=colors[mode], capsize=3, label=f"{mode}, {opt}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.05, color="tab:red", linewidth=0.8, linestyle=":", label="1.05× target")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("step time / baseline (median, IQR)")
    ax.set_title("Step time relative to no offload\n" + subtitle, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    written.append(_save(fig, out, "step_time_ratio.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for opt in optimizers:
        for mode in [m for m in MODES if m in present]:
            ps = sorted((p for p in points if p["optimizer"] == opt and p["mode"] == mode),
                        key=lambda p: p["params"])
            ax.plot([p["params"] for p in ps],
                    [(p["params_device_bytes"] + p["opt_state_device_bytes"]) / MiB for p in ps],
                    linestyle=styles.get(opt, ":"), marker="o", color=colors[mode],
                    label=f"{mode}, {opt}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("device-resident MiB between steps\n(params + optimizer state)")
    ax.set_title("Device memory between steps\n" + subtitle, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    written.append(_save(fig, out, "device_bytes.png"))

    if result["movers"]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        mv = result["movers"]
        xs = [r["mib"] for r in mv]
        for key, label, style in [
            ("to_host", "eqx_offload.to_host", "-o"),
            ("to_device", "eqx_offload.to_device", "-s"),
            ("to_host_8_leaves", "to_host, 8 leaves", ":o"),
            ("numpy_copy", "NumPy copy (fresh buffer)", "--k"),
            ("numpy_copy_no_hugepages", "NumPy copy, no huge pages", ":k"),
            ("numpy_copyto", "NumPy copyto, preallocated", "-.k"),
        ]:
            if all(key + "_gbps" in r for r in mv):
                ax.plot(xs, [r[key + "_gbps"] for r in mv], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("array size (MiB)")
        ax.set_ylabel("GB/s (best of the repetitions)")
        ax.set_title("Eager movers vs a NumPy copy of the same bytes\n" + subtitle, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        written.append(_save(fig, out, "movers.png"))
    return written


def _save(fig: Any, out: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(result: dict[str, Any]) -> Any:
    """Console tables (rich)."""
    from rich.console import Group
    from rich.table import Table

    table = Table(title=f"step time and memory ({result['machine']['device_kind']}, "
                        f"{result['machine']['backend']})")
    for col in ("optimizer", "params", "mode", "step ms", "× baseline", "× manual",
                "device: params+state", "state on host", "compiles", "compile s"):
        table.add_column(col, justify="left" if col in ("optimizer", "mode") else "right")
    for p in result["points"]:
        if p.get("error") is not None:
            table.add_row(p["optimizer"], f"{p['params'] / 1e6:.2f}M", p["mode"],
                          f"[bold red]failed[/bold red]: {p['error'][:60]}")
            continue
        s = p["step_seconds"]
        table.add_row(
            p["optimizer"], f"{p['params'] / 1e6:.2f}M", p["mode"],
            f"{_ms(s['median'])} [{_ms(s['p25'])}, {_ms(s['p75'])}]",
            f"{p['ratio_to_baseline']['median']:.3f}",
            "–" if p["ratio_to_manual"] is None else f"{p['ratio_to_manual']['median']:.3f}",
            format_bytes(p["params_device_bytes"] + p["opt_state_device_bytes"]),
            format_bytes(p["opt_state_host_bytes"]), str(p["compilations"]),
            f"{p['compile_seconds']:.2f}")
    parts: list[Any] = [table]
    if result["movers"]:
        movers = Table(title="eager movers, GB/s (best of "
                             f"{result['config']['mover_repeats']} repetitions)")
        keys = ["to_host", "to_device", "to_host_8_leaves", "numpy_copy",
                "numpy_copy_no_hugepages", "numpy_copyto"]
        movers.add_column("MiB", justify="right")
        for k in keys:
            movers.add_column(k, justify="right")
        for r in result["movers"]:
            movers.add_row(str(r["mib"]), *(f"{r[k + '_gbps']:.2f}" if k + "_gbps" in r else "–"
                                            for k in keys))
        parts.append(movers)
    targets = Table(title="targets")
    targets.add_column("target")
    targets.add_column("result")
    targets.add_column("numbers")
    for t in result["targets"]:
        style = {"pass": "green", "FAIL": "bold red"}.get(t["status"], "yellow")
        targets.add_row(t["target"], f"[{style}]{t['status']}[/{style}]", t["detail"])
    parts.append(targets)
    return Group(*parts)


# --------------------------------------------------------------------------- main

def run_bench(config: BenchConfig, progress: bool = True,
              partial: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Run every measurement of `config`; return the result as a JSON-able dict.
    `partial`, if given, receives the points measured so far after each one."""
    from tqdm.auto import tqdm

    modes = {"baseline", *config.modes} & set(MODES)
    steps = len(config.optimizers) * len(config.sizes) * len(modes) * (
        config.warmup + config.repeats)
    steps += len(config.mover_mib) * (config.mover_repeats + 1)
    started = time.perf_counter()
    load_start = _load_average()
    points: list[dict[str, Any]] = []
    with tqdm(total=steps, desc="bench", disable=not progress, unit="step",
              dynamic_ncols=True, file=sys.stderr) as bar:
        def tick() -> None:
            bar.update(1)

        for optimizer_name in config.optimizers:
            for n in config.sizes:
                bar.set_postfix_str(f"{optimizer_name} {n / 1e6:g}M")
                points.extend(bench_point(optimizer_name, n, config, tick))
                if partial is not None:
                    partial({"config": dataclasses.asdict(config), "points": points})
        bar.set_postfix_str("movers")
        movers = bench_movers(config, tick)
    machine = machine_info()
    # Other processes share the machine: its load says how much (1-minute averages).
    machine["load_average_start"] = load_start
    machine["load_average_end"] = _load_average()
    return {
        "machine": machine,
        "config": dataclasses.asdict(config),
        "points": points,
        "movers": movers,
        "targets": evaluate_targets(points, movers, config, machine["backend"]),
        "wall_seconds": time.perf_counter() - started,
    }


def _load_average() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def bench_main(config: BenchConfig, out: str, progress: bool = True) -> int:
    """Run the benchmark, print the tables, write `bench.json`, `bench.md` and the
    plots to `out`. Returns 1 if a mode's losses differ from the baseline's (a
    correctness failure) or a mode failed to run, else 0: missed performance targets
    are reported, not fatal."""
    from rich.console import Console

    os.makedirs(out, exist_ok=True)

    def partial(so_far: dict[str, Any]) -> None:
        with open(os.path.join(out, "bench.partial.json"), "w") as f:
            json.dump(so_far, f, indent=1)

    result = run_bench(config, progress, partial)
    if os.path.exists(os.path.join(out, "bench.partial.json")):
        os.remove(os.path.join(out, "bench.partial.json"))
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(markdown(result))
    written = plots(result, out)
    console = Console(width=160)
    console.print(render(result))
    console.print(f"wrote {os.path.join(out, 'bench.json')}, {os.path.join(out, 'bench.md')}, "
                  + ", ".join(written) + f" ({result['wall_seconds']:.0f} s)")
    ok = all(p.get("error") is None and p["losses_bitwise_equal_to_baseline"]
             for p in result["points"])
    return 0 if ok else 1

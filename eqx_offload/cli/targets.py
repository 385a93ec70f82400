"""The benchmark's targets: pass, FAIL or n/a per target, with the numbers behind each
verdict. The step-time targets of the CPU run hold for the CPU backend; those against
the copy estimate for an accelerator, where the copies cross a link."""

from collections.abc import Callable
from typing import Any, Optional

from .measure import ACCELERATOR_RTOL


def _measured(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in points if p.get("error") is None]


def _name(p: dict[str, Any]) -> str:
    n = p["params"]
    size = f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"
    return f"{p['workload']} {p['optimizer']} {size}"


def _within(ratio: dict[str, float], limit: float) -> bool:
    """Median at most `limit`, or `limit` inside the interquartile range (noise)."""
    return ratio["median"] <= limit or ratio["p25"] <= limit


_Add = Callable[[str, Optional[bool], str], None]


def evaluate_targets(points: list[dict[str, Any]], movers: list[dict[str, Any]],
                     curves: list[dict[str, Any]], target_min_params: float,
                     backend: str) -> list[dict[str, Any]]:
    """Pass/fail per target, with the numbers behind each verdict."""
    targets: list[dict[str, Any]] = []
    failed = [p for p in points if p.get("error") is not None]
    points = _measured(points)
    on_cpu = backend == "cpu"

    def add(name: str, ok: Optional[bool], detail: str) -> None:
        status = "n/a" if ok is None else ("pass" if ok else "FAIL")
        targets.append({"target": name, "status": status, "detail": detail})

    _step_targets(points, target_min_params, backend, add)
    _run_targets(points, failed, on_cpu, add)
    _movers_target(movers, add)
    _copy_estimate_targets(points, on_cpu, add)
    _bf16_targets(points, curves, on_cpu, add)
    _plan_targets(points, add)
    return targets


def _of(points: list[dict[str, Any]], mode: str,
        where: Callable[[dict[str, Any]], bool] = lambda p: True) -> list[dict[str, Any]]:
    return [p for p in points if p["mode"] == mode and where(p)]


def _step_targets(points: list[dict[str, Any]], target_min_params: float, backend: str,
                  add: _Add) -> None:
    """The CPU run's step-time targets (MLP): against the baseline and the manual pattern."""
    on_cpu = backend == "cpu"
    scope = "" if on_cpu else f" (defined for the CPU backend; measured on {backend})"
    big_off = _of(points, "eqx_offload", lambda p: p["workload"] == "mlp"
                  and p["params"] >= target_min_params)
    if big_off:
        worst = max(big_off, key=lambda p: p["ratio_to_baseline"]["median"])
        add(f"MLP: step time <= 1.05x baseline at >= {target_min_params / 1e6:.0f}M params"
            + scope,
            all(p["ratio_to_baseline"]["median"] <= 1.05 for p in big_off),
            "; ".join(f"{_name(p)}: {p['ratio_to_baseline']['median']:.3f}x" for p in big_off)
            + f" (worst {worst['ratio_to_baseline']['median']:.3f}x)")
    else:
        add(f"MLP: step time at >= {target_min_params / 1e6:.0f}M params", None,
            "no configuration that large in this run")
    off = _of(points, "eqx_offload")
    vs_manual = [p for p in (big_off if on_cpu else off) if p["ratio_to_manual"] is not None]
    add("eqx_offload step time <= manual pattern ("
        + (f"MLP >= {target_min_params / 1e6:.0f}M" if on_cpu else "every point")
        + "; pass: median ratio <= 1, or its interquartile range contains 1)",
        all(_within(p["ratio_to_manual"], 1.0) for p in vs_manual) if vs_manual else None,
        "; ".join(f"{_name(p)}: {p['ratio_to_manual']['median']:.3f}x "
                  f"[{p['ratio_to_manual']['p25']:.3f}, {p['ratio_to_manual']['p75']:.3f}]"
                  for p in vs_manual))


def _run_targets(points: list[dict[str, Any]], failed: list[dict[str, Any]], on_cpu: bool,
                 add: _Add) -> None:
    """State placement, compilations, losses as promised (bitwise on the CPU, to 1e-4
    relative on an accelerator), and every mode ran."""
    off = _of(points, "eqx_offload")
    add("optimizer state: 0 device bytes between steps (arrays of >= 1 dimension)",
        all(p["opt_state_nonscalar_device_bytes"] == 0 for p in off) if off else None,
        "; ".join(sorted({f"{p['optimizer']}: {p['opt_state_nonscalar_device_bytes']} B of "
                          f"arrays, {p['opt_state_device_bytes']} B in all (0-d step "
                          "counters stay on the device by default)" for p in off})))

    def counts(mode: str) -> str:
        return ", ".join(sorted({str(p["compilations"]) for p in _of(points, mode)})) or "-"

    add("exactly one compilation per configuration (eqx_offload)",
        all(p["compilations"] == 1 for p in off) if off else None,
        f"{counts('eqx_offload')} compilation(s); baseline: {counts('baseline')}; "
        f"manual: {counts('manual')}")
    bitwise = [p for p in points if p["bitwise_expected"]]
    if on_cpu:
        add("losses bitwise equal to the baseline (every bitwise mode)",
            all(p["losses_bitwise_equal_to_baseline"] for p in bitwise),
            "; ".join(f"{p['mode']} ({_name(p)})" for p in bitwise
                      if not p["losses_bitwise_equal_to_baseline"]))
    else:  # XLA compiles the forward and backward passes of two programs differently
        add(f"losses within {ACCELERATOR_RTOL:g} relative of the baseline (every bitwise "
            "mode; bitwise on the CPU)",
            all(p["losses_max_rel_diff"] <= ACCELERATOR_RTOL for p in bitwise),
            "; ".join(f"{p['mode']} ({_name(p)}): {p['losses_max_rel_diff']:.1e}"
                      for p in bitwise))
    add("every mode ran", not failed,
        "; ".join(f"{p['mode']} ({_name(p)}): {p['error']}" for p in failed))


def _copy_estimate_targets(points: list[dict[str, Any]], on_cpu: bool, add: _Add) -> None:
    """Against the copy estimate, for an accelerator."""
    gpu = None if on_cpu else True
    lm = [p for p in points if p["workload"] == "transformer" and p["mode"] == "baseline"]
    add("transformer sizing: baseline step >= 2x the state's one-way copy"
        + (" (for an accelerator; on the CPU the numbers only)" if on_cpu else ""),
        None if on_cpu or not lm else all(
            p["floor"]["baseline_over_one_way"] >= 2 for p in lm),
        "; ".join(f"{_name(p)}: baseline/copy = {p['floor']['baseline_over_one_way']:.2f} "
                  f"({p['step_seconds']['median'] * 1e3:.2f} ms vs "
                  f"{p['floor']['one_way_seconds']['median'] * 1e3:.2f} ms for "
                  f"{p['floor']['state_bytes'] / 2**20:.1f} MiB)" for p in lm)
        or "no transformer in this run")
    streamed = _of(points, "streamed",
                   lambda p: p["workload"] == "mlp" and p["optimizer"] == "adam")
    if streamed:
        largest = max(streamed, key=lambda p: p["params"])
        r = largest["ratio_to_floor"]
        add("streamed, Adam, largest MLP: step <= 1.2x the copy estimate",
            gpu and _within(r, 1.2) if largest["params"] >= 90e6 else None,
            f"{_name(largest)}: {r['median']:.3f}x [{r['p25']:.3f}, {r['p75']:.3f}] of "
            f"max(baseline, one-way copy) = "
            f"{largest['floor']['full_duplex_seconds']['median'] * 1e3:.2f} ms"
            + ("" if largest["params"] >= 90e6 else " (defined at 100M parameters)"))


def _plan_targets(points: list[dict[str, Any]],
                  add: _Add) -> None:
    """The accelerator targets, in XLA's GPU plan of each point (recorded
    with `--plan`): the default step frees 80% of the state's bytes at the peak, and 90%
    of the state's copies overlap compute."""
    base = {(p["workload"], p["optimizer"], p["params"]): p["plan"] for p in points
            if p["mode"] == "baseline" and p.get("plan")}
    pairs = []
    for p in points:
        if p["mode"] != "eqx_offload" or not p.get("plan"):
            continue
        for target, plan in p["plan"].items():
            b = base.get((p["workload"], p["optimizer"], p["params"]), {}).get(target)
            if b and "error" not in plan and "error" not in b:
                pairs.append((f"{_name(p)} {target}", plan, b))
    if not pairs:
        return
    add("plan: default step's device peak <= no offload's - 80% of the state moved",
        all(pl["device_peak_bytes"] <= b["device_peak_bytes"] - 0.8 * pl["host_bytes"]
            for _, pl, b in pairs),
        "; ".join(f"{n}: {pl['device_peak_bytes'] / 2**20:.2f} MiB vs "
                  f"{(b['device_peak_bytes'] - 0.8 * pl['host_bytes']) / 2**20:.2f} MiB"
                  for n, pl, b in pairs))

    def overlapped(pl: dict[str, Any]) -> float:
        n = pl["copies_to_device"] + pl["copies_to_host"]
        return 1.0 if n == 0 else (pl["overlapped_to_device"] + pl["overlapped_to_host"]) / n

    add("plan: >= 90% of the default step's copies overlap compute",
        all(overlapped(pl) >= 0.9 for _, pl, _ in pairs),
        "; ".join(f"{n}: {overlapped(pl):.0%}" for n, pl, _ in pairs))


def _movers_target(movers: list[dict[str, Any]],
                   add: _Add) -> None:
    large = [m for m in movers if m["mib"] >= 16]
    name = "eager movers >= 50% of NumPy copy bandwidth (arrays >= 16 MiB, best of the " \
           "interleaved repetitions)"
    if not large:
        add(name, None, "no array that large in this run")
        return
    details = []
    ok = True
    for m in large:
        frac = min(m["to_host_gbps"], m["to_device_gbps"]) / m["numpy_copy_gbps"]
        ok = ok and frac >= 0.5
        extra = ""
        if "numpy_copy_no_hugepages_gbps" in m:
            frac_plain = (min(m["to_host_gbps"], m["to_device_gbps"])
                          / m["numpy_copy_no_hugepages_gbps"])
            extra = f", {frac_plain:.0%} of a copy without huge pages"
        details.append(f"{m['mib']} MiB: to_host {m['to_host_gbps']:.2f}, to_device "
                       f"{m['to_device_gbps']:.2f}, numpy {m['numpy_copy_gbps']:.2f} GB/s "
                       f"= {frac:.0%}{extra}")
    add(name, ok, "; ".join(details))


def _bf16_targets(points: list[dict[str, Any]], curves: list[dict[str, Any]], on_cpu: bool,
                  add: _Add) -> None:
    """`host_bf16` against full precision (`eqx_offload`) at the same points."""
    full = {(p["workload"], p["optimizer"], p["params"]): p
            for p in points if p["mode"] == "eqx_offload"}
    pairs = [(p, full[key]) for p in points if p["mode"] == "host_bf16"
             and (key := (p["workload"], p["optimizer"], p["params"])) in full]
    if not pairs:
        return
    add("host_bf16: bytes in host memory (so bytes moved) <= half of full precision's",
        all(b["opt_state_host_bytes"] <= 0.5 * f["opt_state_host_bytes"] + 64
            for b, f in pairs),
        "; ".join(f"{_name(b)}: {b['opt_state_host_bytes']} B vs {f['opt_state_host_bytes']} B"
                  for b, f in pairs))

    def cost(p: dict[str, Any]) -> float:  # time above the baseline, in baseline steps
        return float(p["ratio_to_baseline"]["median"]) - 1.0

    heavy = [(b, f) for b, f in pairs if cost(f) > 0.5]
    add("host_bf16: transfer cost (step - baseline) <= about half of full precision's "
        "(points where it is > 0.5 baseline steps; for an accelerator)",
        None if on_cpu or not heavy else all(cost(b) <= 0.55 * cost(f) for b, f in heavy),
        "; ".join(f"{_name(b)}: {cost(b):.3f} vs {cost(f):.3f} baseline steps"
                  for b, f in pairs))
    for c in curves:
        if c["mode"] == "host_bf16" and c.get("error") is None:
            add(f"host_bf16: final loss documented ({c['workload']}, {c['steps']} steps)",
                None,
                f"{c['final']:.6g} vs {c['baseline_final']:.6g} full precision "
                f"({c['final_relative_difference']:+.2%})")

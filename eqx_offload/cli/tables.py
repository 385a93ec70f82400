"""The benchmark's results as Markdown (for the docs) and as console tables (rich)."""

from collections.abc import Iterable
from typing import Any, Optional, Union


def format_bytes(n: Union[int, float]) -> str:
    """`1536` -> `"1.5 KiB"`. (The library's own is private, `_core.leaves`; the command
    line uses only the public API, and a byte formatter is no part of that.)"""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}" if s >= 0.01 else f"{s * 1e3:.2f}"


def _ratio(r: Optional[dict[str, float]]) -> str:
    return "–" if r is None else f"{r['median']:.3f}"


def _gbps(v: Optional[float], digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _params(p: dict[str, Any]) -> str:
    return f"{p['params'] / 1e6:.1f}M" if p["params"] >= 1e5 else f"{p['params'] / 1e3:.1f}k"


def floors(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One baseline point per (workload, optimizer, size): the point's copy estimate."""
    return [p for p in points if p["mode"] == "baseline" and p.get("error") is None]


def markdown(result: dict[str, Any]) -> str:
    """The results as Markdown tables (for the README and the docs)."""
    lines = [_run_line(result)] + _point_lines(result["points"])
    lines += _plan_lines(result["points"])
    lines += _floor_lines(result["points"])
    if result["movers"]:
        lines += _mover_lines(result["movers"], result["config"]["mover_repeats"])
    if result["loss_curves"]:
        lines += _curve_lines(result["loss_curves"])
    if result.get("skipped"):
        lines += ["", "Skipped (time limit): " + "; ".join(result["skipped"]) + "."]
    lines += ["", "| target | result | numbers |", "| --- | --- | --- |"]
    for t in result["targets"]:
        lines.append(f"| {t['target']} | **{t['status']}** | {t['detail']} |")
    return "\n".join(lines) + "\n"


def _run_line(result: dict[str, Any]) -> str:
    """The machine, the versions and the configuration the run measured on."""
    m, config = result["machine"], result["config"]
    return (
        f"Measured {m['date']} on **{m['device_kind']}** (backend `{m['backend']}`, "
        f"{m['cpu_count']} CPU cores: {m['cpu']}), JAX {m['jax_version']}, "
        f"MLP batch {config['batch']}, transformer "
        f"{config['lm']['layers']}×{config['lm']['width']} (batch {config['lm']['batch']} × "
        f"{config['lm']['seq']} tokens), {config['repeats']} interleaved repetitions per "
        f"point; load average (1 min) {m.get('load_average_start')} at the start, "
        f"{m.get('load_average_end')} at the end.")


def _table_lines(intro: tuple[str, ...], columns: tuple[str, ...], align: str,
                 rows: Iterable[str]) -> list[str]:
    """A Markdown table after a blank line and the paragraphs of `intro` (each followed by
    a blank line): a header of `columns`, left-aligned where `align` has `l`, right-aligned
    where it has `r`, then `rows`."""
    header = "| " + " | ".join(columns) + " |"
    rule = "| " + " | ".join({"l": "---", "r": "---:"}[a] for a in align) + " |"
    return ["", *(line for paragraph in intro for line in (paragraph, "")), header, rule, *rows]


def _failed(head: str, error: str, empty: int) -> str:
    """A row that ends in `failed: <error>` after the cells of `head`, then `empty` empty cells."""
    return f"{head} failed: {error.replace('|', '/')} " + " ".join("|" * empty)


def _point_lines(points: list[dict[str, Any]]) -> list[str]:
    """The main table: a row per point and mode (step time, ratios, bytes, compiles)."""
    columns = ("workload", "optimizer", "params", "mode", "step ms (median [p25, p75])",
               "× baseline", "× estimate", "× baseline, process CPU time",
               "device bytes: params + opt state", "opt state on host", "compilations",
               "compile s", "temp / peak (memory_analysis)")
    return _table_lines((), columns, "llrl" + "r" * 9, map(_point_row, points))


def _point_row(p: dict[str, Any]) -> str:
    head = f"| {p['workload']} | {p['optimizer']} | {_params(p)} | {p['mode']} |"
    if p.get("error") is not None:
        return _failed(head, p["error"], 9)
    s = p["step_seconds"]
    ma = p["memory_analysis"] or {}
    temp, peak = ma.get("temp_size_in_bytes"), ma.get("peak_memory_in_bytes")
    mem = (f"{format_bytes(temp) if temp is not None else '–'} / "
           f"{format_bytes(peak) if peak is not None else '–'}")
    return (f"{head} {_ms(s['median'])} [{_ms(s['p25'])}, {_ms(s['p75'])}] | "
            f"{_ratio(p['ratio_to_baseline'])} | {_ratio(p['ratio_to_floor'])} | "
            f"{_ratio(p['cpu_ratio_to_baseline'])} | "
            f"{format_bytes(p['params_device_bytes'] + p['opt_state_device_bytes'])} | "
            f"{format_bytes(p['opt_state_host_bytes'])} | {p['compilations']} | "
            f"{p['compile_seconds']:.2f} | {mem} |")


def _floor_lines(points: list[dict[str, Any]]) -> list[str]:
    """What × estimate means, and the copy estimate of each baseline point."""
    intro = (
        "× estimate: the step over the copy estimate `max(baseline step, one-way copy)` "
        "of the same repetition (median of the per-repetition ratios): what a step whose "
        "copies overlap fully would take if a copy inside the step cost what a bare "
        "`jax.device_put` does. Not a lower bound: a step can beat it (on the CPU a copy "
        "inside the program costs less than an eager one). JSON: `ratio_to_floor`.",
        "Copy estimate per point: one bare copy of the optimizer state's offloaded "
        "leaves each way (`jax.device_put`, pinned_host ↔ device), interleaved with the "
        "steps:",
    )
    columns = ("workload", "optimizer", "params", "state bytes", "to device ms (GB/s)",
               "to host ms (GB/s)", "baseline ms", "estimate: full duplex ms", "no overlap ms",
               "serial ms", "baseline / one-way copy")
    rows = []
    for p in floors(points):
        f = p["floor"]
        rows.append(
            f"| {p['workload']} | {p['optimizer']} | {_params(p)} | "
            f"{format_bytes(f['state_bytes'])} | "
            f"{_ms(f['to_device_seconds']['median'])} ({_gbps(f['to_device_gbps'])}) | "
            f"{_ms(f['to_host_seconds']['median'])} ({_gbps(f['to_host_gbps'])}) | "
            f"{_ms(p['step_seconds']['median'])} | {_ms(f['full_duplex_seconds']['median'])} | "
            f"{_ms(f['no_overlap_seconds']['median'])} | {_ms(f['serial_seconds']['median'])} | "
            f"{f['baseline_over_one_way']:.2f} |")
    return _table_lines(intro, columns, "ll" + "r" * 9, rows)


def _mover_lines(movers: list[dict[str, Any]], repeats: int) -> list[str]:
    """The eager movers' bandwidth beside NumPy's copies."""
    keys = ("to_host", "to_device", "to_host_8_leaves", "numpy_copy", "numpy_copy_no_hugepages",
            "numpy_copyto")
    columns = ("array", "to_host", "to_device", "to_host, 8 leaves", "NumPy copy",
               "NumPy copy, no huge pages", "NumPy copyto (preallocated)")
    rows = [f"| {mv['mib']} MiB | " + " | ".join(_gbps(mv.get(k + "_gbps"), 2) for k in keys)
            + " |" for mv in movers]
    return _table_lines((f"Eager movers, GB/s (best of {repeats} interleaved repetitions):",),
                        columns, "r" * 7, rows)


def _curve_lines(curves: list[dict[str, Any]]) -> list[str]:
    """The loss curves' final values against the baseline's."""
    columns = ("workload", "optimizer", "mode", "steps", "final loss, baseline",
               "final loss, mode", "relative difference", "max abs difference", "bitwise equal")
    rows = []
    for c in curves:
        head = f"| {c['workload']} | {c['optimizer']} | {c['mode']} |"
        if c.get("error") is not None:
            rows.append(_failed(head, c["error"], 6))
            continue
        rows.append(
            f"{head} {c['steps']} | {c['baseline_final']:.6g} | {c['final']:.6g} | "
            f"{c['final_relative_difference']:+.3%} | {c['max_abs_difference']:.3g} | "
            f"{c['bitwise_equal']} |")
    return _table_lines(("Loss curves against the baseline (same model, data and "
                         "initialisation):",), columns, "lllrrrrrl", rows)


def _plan_lines(points: list[dict[str, Any]]) -> list[str]:
    """XLA's GPU plan of each point and mode, beside the measured table (if recorded)."""
    planned = [p for p in points if p.get("error") is None and p.get("plan")]
    if not planned:
        return []
    baselines = {(p["workload"], p["optimizer"], p["params"]): p["plan"] for p in planned
                 if p["mode"] == "baseline"}
    rows = []
    for p in planned:
        for target, plan in p["plan"].items():
            head = f"| {p['workload']} | {p['optimizer']} | {_params(p)} | {p['mode']} | {target} |"
            if "error" in plan:
                rows.append(_failed(head, plan["error"], 5))
                continue
            base = baselines.get((p["workload"], p["optimizer"], p["params"]), {}).get(target)
            ratio = ("–" if not base or "error" in base
                     else f"{plan['device_peak_bytes'] / base['device_peak_bytes']:.2f}")
            rows.append(
                f"{head} {format_bytes(plan['device_peak_bytes'])} | {ratio} | "
                f"{format_bytes(plan['host_bytes'])} | "
                f"{plan['overlapped_to_device']}/{plan['copies_to_device']} | "
                f"{plan['overlapped_to_host']}/{plan['copies_to_host']} |")
    columns = ("workload", "optimizer", "params", "mode", "GPU", "device peak", "× baseline's",
               "host", "copies to device overlapped", "copies to host overlapped")
    intro = ("XLA's plan for the GPU of each point (`eqx_offload.planner.gpu_plan`, compiled "
             "without a GPU: a plan, not a measurement):",)
    return _table_lines(intro, columns, "llrll" + "r" * 5, rows)


def _short(p: dict[str, Any]) -> str:
    """`"mlp adam 20.8k"`, `"lm adam 17.2k"`: a point in a narrow console column."""
    workload = "lm" if p["workload"] == "transformer" else p["workload"]
    return f"{workload} {p['optimizer']} {_params(p)}"


def render(result: dict[str, Any]) -> Any:
    """The main tables for the console, as a `rich` renderable, within 100 columns (the
    Markdown has every column)."""
    from rich.console import Group
    from rich.text import Text

    main, failed = _step_table(result)
    note = Text("device: params + opt state bytes on the device between steps; host: opt "
                "state in host memory. × est.: step / max(baseline step, one-way copy), an "
                "estimate, not a lower bound. bench.md has every column.")
    parts: list[Any] = [main, *failed, note, _copy_table(result["points"])]
    if result["loss_curves"]:
        parts.append(_curve_table(result["loss_curves"]))
    parts.append(_target_table(result["targets"]))
    return Group(*parts)


def _table(title: str, columns: tuple[str, ...], left: int) -> Any:
    """A console table whose first `left` columns are left-aligned labels."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i < left else "right", no_wrap=i < left)
    return t


def _step_table(result: dict[str, Any]) -> tuple[Any, list[Any]]:
    """Step time and memory per point and mode, and a red line per failed mode."""
    from rich.text import Text

    main = _table(f"step time and memory ({result['machine']['device_kind']}, "
                  f"{result['machine']['backend']})",
                  ("point", "mode", "step ms", "× base", "× manual", "× est.", "device",
                   "host"), 2)
    failed = []
    for p in result["points"]:
        head = (_short(p), p["mode"])
        if p.get("error") is not None:
            main.add_row(*head, "[bold red]failed[/bold red]")
            failed.append(Text(f"{p['mode']} ({_short(p)}) failed: {p['error'][:200]}",
                               style="red"))
            continue
        main.add_row(
            *head, _ms(p["step_seconds"]["median"]), _ratio(p["ratio_to_baseline"]),
            _ratio(p["ratio_to_manual"]), _ratio(p["ratio_to_floor"]),
            format_bytes(p["params_device_bytes"] + p["opt_state_device_bytes"]),
            format_bytes(p["opt_state_host_bytes"]))
    return main, failed


def _copy_table(points: list[dict[str, Any]]) -> Any:
    """The copy estimate of each baseline point."""
    copies = _table("copy estimate: one bare copy of the state each way",
                    ("point", "state", "to dev ms", "to host ms", "base ms", "est. ms",
                     "base / copy"), 1)
    for p in floors(points):
        f = p["floor"]
        copies.add_row(
            _short(p), format_bytes(f["state_bytes"]),
            _ms(f["to_device_seconds"]["median"]), _ms(f["to_host_seconds"]["median"]),
            _ms(p["step_seconds"]["median"]), _ms(f["full_duplex_seconds"]["median"]),
            f"{f['baseline_over_one_way']:.2f}")
    return copies


def _curve_table(loss_curves: list[dict[str, Any]]) -> Any:
    """The loss curves' final values against the baseline's."""
    from rich import box
    from rich.table import Table

    curves = Table(title="loss curves against the baseline", box=box.SIMPLE_HEAD)
    for col in ("workload", "mode", "steps", "final, baseline", "final, mode",
                "relative difference", "bitwise"):
        curves.add_column(col)
    for c in loss_curves:
        if c.get("error") is not None:
            curves.add_row(c["workload"], c["mode"], f"[bold red]failed[/bold red]: "
                           f"{c['error'][:60]}")
            continue
        curves.add_row(c["workload"], c["mode"], str(c["steps"]),
                       f"{c['baseline_final']:.6g}", f"{c['final']:.6g}",
                       f"{c['final_relative_difference']:+.3%}", str(c["bitwise_equal"]))
    return curves


def _target_table(targets: list[dict[str, Any]]) -> Any:
    """Pass, FAIL or n/a per target, coloured, with its numbers."""
    from rich import box
    from rich.table import Table

    table = Table(title="targets", box=box.SIMPLE_HEAD)
    for col in ("target", "result", "numbers"):
        table.add_column(col)
    for t in targets:
        style = {"pass": "green", "FAIL": "bold red"}.get(t["status"], "yellow")
        table.add_row(t["target"], f"[{style}]{t['status']}[/{style}]", t["detail"])
    return table

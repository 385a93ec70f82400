"""The benchmark's plots (PNG, matplotlib): step time against the baseline and against
the copy estimate, device bytes between steps, the eager movers, and loss curves."""

import os
from typing import Any

from .modes import MODES


MiB = 1 << 20
_STYLES = {"adam": "-", "adafactor": "--"}
_COLORS = {"baseline": "tab:gray", "manual": "tab:orange", "eqx_offload": "tab:blue",
           "streamed": "tab:green", "host_compute": "tab:purple", "host_bf16": "tab:red"}


def _color(mode: str) -> str:
    return _COLORS.get(mode, "tab:brown")


def plots(result: dict[str, Any], out: str) -> list[str]:
    """Write the plots of `result` to `out`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")

    m = result["machine"]
    subtitle = f"{m['device_kind']} ({m['backend']}), JAX {m['jax_version']}"
    points = [p for p in result["points"] if p.get("error") is None]
    written = [
        _ratio_plot(points, "ratio_to_baseline", "step time / baseline (median, IQR)",
                    "Step time relative to no offload\n" + subtitle,
                    os.path.join(out, "step_time_ratio.png"), line=1.05,
                    line_label="1.05× target (CPU)"),
        _ratio_plot(points, "ratio_to_floor",
                    "step time / max(baseline, one-way copy) (median, IQR)",
                    "Step time relative to the copy estimate\n" + subtitle,
                    os.path.join(out, "floor_ratio.png"), line=1.2,
                    line_label="1.2× target (streamed, 100M)"),
        _bytes_plot(points, subtitle, os.path.join(out, "device_bytes.png")),
    ]
    if result["movers"]:
        written.append(_movers_plot(result["movers"], subtitle, os.path.join(out, "movers.png")))
    curves = [c for c in result["loss_curves"] if c.get("error") is None]
    if curves:
        written.append(_loss_plot(curves, subtitle, os.path.join(out, "loss_curves.png")))
    return written


def _series(points: list[dict[str, Any]], workload: str, optimizer: str,
            mode: str) -> list[dict[str, Any]]:
    return sorted((p for p in points if p["workload"] == workload
                   and p["optimizer"] == optimizer and p["mode"] == mode),
                  key=lambda p: p["params"])


def _ratio_plot(points: list[dict[str, Any]], key: str, ylabel: str, title: str, path: str,
                line: float, line_label: str) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    optimizers = sorted({p["optimizer"] for p in points})
    present = [mode for mode in MODES if any(p["mode"] == mode for p in points)]
    for opt in optimizers:
        for mode in present:
            if key == "ratio_to_baseline" and mode == "baseline":
                continue
            for workload, marker in (("mlp", "o"), ("transformer", "*")):
                ps = _series(points, workload, opt, mode)
                if not ps:
                    continue
                med = [p[key]["median"] for p in ps]
                lo = [p[key]["median"] - p[key]["p25"] for p in ps]
                hi = [p[key]["p75"] - p[key]["median"] for p in ps]
                ax.errorbar([p["params"] for p in ps], med, yerr=[lo, hi],
                            linestyle=_STYLES.get(opt, ":") if workload == "mlp" else "none",
                            marker=marker, markersize=5 if marker == "o" else 11,
                            color=_color(mode), capsize=3,
                            label=f"{mode}, {opt}" + (", LM" if workload != "mlp" else ""))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(line, color="tab:red", linewidth=0.8, linestyle=":", label=line_label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (lines: MLP; stars: transformer LM)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def _bytes_plot(points: list[dict[str, Any]], subtitle: str, path: str) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    present = [mode for mode in MODES if any(p["mode"] == mode for p in points)]
    for opt in sorted({p["optimizer"] for p in points}):
        for mode in present:
            ps = _series(points, "mlp", opt, mode)
            ax.plot([p["params"] for p in ps],
                    [(p["params_device_bytes"] + p["opt_state_device_bytes"]) / MiB for p in ps],
                    linestyle=_STYLES.get(opt, ":"), marker="o", color=_color(mode),
                    label=f"{mode}, {opt}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MLP parameters")
    ax.set_ylabel("device-resident MiB between steps\n(params + optimizer state)")
    ax.set_title("Device memory between steps\n" + subtitle, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def _movers_plot(movers: list[dict[str, Any]], subtitle: str, path: str) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["mib"] for r in movers]
    for key, label, style in [
        ("to_host", "eqx_offload.to_host", "-o"),
        ("to_device", "eqx_offload.to_device", "-s"),
        ("to_host_8_leaves", "to_host, 8 leaves", ":o"),
        ("numpy_copy", "NumPy copy (fresh buffer)", "--k"),
        ("numpy_copy_no_hugepages", "NumPy copy, no huge pages", ":k"),
        ("numpy_copyto", "NumPy copyto, preallocated", "-.k"),
    ]:
        if all(key + "_gbps" in r for r in movers):
            ax.plot(xs, [r[key + "_gbps"] for r in movers], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("array size (MiB)")
    ax.set_ylabel("GB/s (best of the repetitions)")
    ax.set_title("Eager movers vs a NumPy copy of the same bytes\n" + subtitle, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def _loss_plot(curves: list[dict[str, Any]], subtitle: str, path: str) -> str:
    """Per workload: the loss curves (top) and each mode minus the baseline (bottom)."""
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(c["workload"] for c in curves))
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 6.5),
                             squeeze=False, sharex="col")
    for column, workload in enumerate(workloads):
        top, bottom = axes[0][column], axes[1][column]
        mine = [c for c in curves if c["workload"] == workload]
        steps = range(1, mine[0]["steps"] + 1)
        top.plot(steps, mine[0]["baseline"], color=_color("baseline"), linewidth=2,
                 label="baseline")
        for c in mine:
            top.plot(steps, c["losses"], color=_color(c["mode"]), linewidth=1,
                     label=f"{c['mode']} (final {c['final']:.4g} vs {c['baseline_final']:.4g})")
            bottom.plot(steps, [a - b for a, b in zip(c["losses"], c["baseline"])],
                        color=_color(c["mode"]), label=c["mode"])
        top.set_yscale("log")
        top.set_title(f"{workload}, {mine[0]['optimizer']}: loss\n{subtitle}", fontsize=10)
        top.legend(fontsize=8)
        top.grid(True, which="both", alpha=0.3)
        bottom.axhline(0.0, color="black", linewidth=0.8)
        bottom.set_xlabel("step")
        bottom.set_ylabel("mode loss − baseline loss")
        bottom.legend(fontsize=8)
        bottom.grid(True, alpha=0.3)
    return _save(fig, path)


def _save(fig: Any, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

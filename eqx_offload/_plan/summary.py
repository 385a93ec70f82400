"""The text of a `Plan` for a person (`Plan.summary`): its device peak and what it is
made of, its host bytes, its copies each way, its floors."""

from typing import Any

from .targets import TpuTarget


MiB = 1 << 20


def summary_text(plan: Any) -> str:
    """A few lines for a person: peak, host bytes, copies, overlap."""
    def count(direction: str) -> str:
        copies = plan.copies_to(direction)
        over = sum(c.overlapped for c in copies)
        runs = sum(c.count for c in copies)
        looped = "" if runs == len(copies) else f", {runs} runs with the loops'"
        return (f"{len(copies)} copies {direction.replace('_', ' ')}{looped} "
                f"({plan.bytes_moved(direction) / MiB:.1f} MiB moved), "
                f"{over} overlap compute")
    verdict = "fits" if plan.fits else "does NOT fit"
    devices = "" if plan.n_devices == 1 else f" x {plan.n_devices} devices (per device)"
    pools = [] if plan.host_limit_bytes is None else [
        f"the pinned pool's {plan.host_limit_bytes / MiB:.0f} MiB"]
    if plan.host_memory_bytes is not None:
        pools.append(f"the given {plan.host_memory_bytes / MiB:.0f} MiB")
    host_of = " of " + " and ".join(pools) if pools else ""
    compiler = "a TPU" if isinstance(plan.chip, TpuTarget) else "a GPU"
    lines = [
        f"XLA's plan for {plan.target}{devices} (compiled without {compiler}; a plan, "
        "not a measurement)",
        f"  device peak  {plan.device_peak_bytes / MiB:10.1f} MiB (XLA's need) of "
        f"{plan.usable_device_bytes / MiB:.1f} MiB JAX allocates "
        f"({plan.memory_fraction:.0%} of {plan.device_memory_size / MiB:.1f} MiB: "
        f"{plan.memory_fraction_source}): {verdict}",
        f"    arguments {plan.argument_bytes / MiB:.1f} + temporaries "
        f"{plan.temp_bytes / MiB:.1f} + outputs {plan.output_bytes / MiB:.1f} "
        f"- aliased {plan.alias_bytes / MiB:.1f} MiB (the temporaries are one "
        "reservation for the schedule; a chip's peak_bytes_in_use leaves them out)",
        f"  host         {plan.host_total_bytes / MiB:10.1f} MiB{host_of}"
        + ("" if plan.host_fits else ": does NOT fit"),
        f"    arguments {plan.host_argument_bytes / MiB:.1f} + temporaries "
        f"{plan.host_temp_bytes / MiB:.1f} + outputs not aliased to donated inputs "
        f"{plan.unaliased_host_output_bytes / MiB:.1f} MiB",
        f"  {count('to_device')}",
        f"  {count('to_host')}",
    ]
    if plan.collectives:
        kinds: dict[str, list[int]] = {}
        for c in plan.collectives:
            n, b = kinds.setdefault(c.kind, [0, 0])
            kinds[c.kind] = [n + c.count, b + c.nbytes * c.count]
        lines.append("  collectives: " + ", ".join(
            f"{n} {kind} ({b / MiB:.1f} MiB)" for kind, (n, b) in kinds.items()))
    if plan.matmul_flops:
        lines.append(
            f"  floors (lower bounds, not predictions): compute "
            f"{plan.compute_floor_seconds * 1e3:.2f} ms, transfer "
            f"{plan.transfer_floor_seconds * 1e3:.2f} ms, ratio {plan.floor_ratio:.2f}")
    lines.extend(_notes(plan))
    lines.append(f"  compiler options: {dict(plan.compiler_options) or 'XLA defaults'}")
    settings = plan.run_settings()
    if settings:
        lines.append("  run with: " + " ".join(settings))
    return "\n".join(lines)


def _notes(plan: Any) -> list[str]:
    """What a reader of the numbers above should know: temporaries XLA:TPU kept on the
    chip, host outputs written into new buffers, the predicted step time."""
    notes = []
    if isinstance(plan.chip, TpuTarget) and plan.temp_bytes == 0:
        notes.append(
            "  (no temporaries in HBM: XLA:TPU keeps a small step's in its on-chip memory, "
            "which no figure here counts; a step that copies from host memory needs HBM "
            "buffers for them, so its peak can be a multiple of this one's)")
    if plan.unaliased_host_output_bytes:
        notes.append(
            f"  ! {plan.unaliased_host_output_bytes / MiB:.1f} MiB of host outputs are not "
            "aliased to donated inputs: each step allocates them anew beside the inputs "
            "(the host holds both) and writes them slowly (0.47 GB/s on a v5e). Donate "
            "the arguments they replace: `filter_jit(donate=...)`.")
    if plan.predicted_step_seconds is not None:
        notes.append(
            f"  predicted step {plan.predicted_step_seconds * 1e3:.1f} ms (the calibrated "
            "schedule model, `docs/results.md`: a model, not a measurement)")
    return notes

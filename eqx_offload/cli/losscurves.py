"""Loss curves of a mode against the baseline: the same model, data and optimizer,
trained for a number of steps both ways, to show what a mode that is not bitwise (such as
`host_dtype=jnp.bfloat16`) does to training."""

import sys
from collections.abc import Callable
from typing import Any, Optional

import jax
import numpy as np

from .config import BenchConfig
from .measure import bitwise_equal
from .models import OPTIMIZERS, Workload
from .modes import MODES


def train_losses(mode: str, workload: Workload, optimizer_name: str, steps: int,
                 learning_rate: float, batches: int = 8) -> np.ndarray:
    """The loss of each of `steps` steps of `mode`, from `workload.make_model(0)`,
    cycling over `batches` batches of `workload.batches(batches, 0)`."""
    data = workload.batches(batches, 0)
    runner = MODES[mode].build(mode, OPTIMIZERS[optimizer_name](learning_rate),
                               workload.make_model(0), workload.loss)
    for i in range(steps):
        runner.run(data[i % len(data)])
    return np.stack([np.asarray(jax.device_get(v)) for v in runner.losses])


def compare(mode: str, baseline: np.ndarray, losses: np.ndarray) -> dict[str, Any]:
    """How the loss curve `losses` of `mode` differs from the baseline's."""
    return {
        "mode": mode,
        "error": None,
        "steps": int(losses.size),
        "baseline": [float(v) for v in baseline],
        "losses": [float(v) for v in losses],
        "baseline_final": float(baseline[-1]),
        "final": float(losses[-1]),
        "final_relative_difference": float((losses[-1] - baseline[-1]) / abs(baseline[-1])),
        "max_abs_difference": float(np.max(np.abs(losses - baseline))),
        "bitwise_equal": bitwise_equal(losses, baseline),
    }


def loss_curves(config: BenchConfig, progress: bool = False,
                out_of_time: Optional[Callable[[str], bool]] = None) -> list[dict[str, Any]]:
    """For every workload of `config` (the MLP at its smallest size) and every mode in
    `config.loss_curves`: the mode's loss curve next to the baseline's, over
    `config.loss_steps` steps of `config.loss_optimizer` at learning rate 1e-3.
    `out_of_time(what)`, if given, says whether to skip a workload's curves."""
    if not config.loss_curves:
        return []
    workloads = config.workload_list()
    mlps = [w for w in workloads if w.name == "mlp"]
    smallest = mlps[int(np.argmin(config.sizes))] if mlps else None
    chosen = [w for w in workloads if w.name != "mlp" or w is smallest]
    results = []
    for workload in chosen:
        if out_of_time is not None and out_of_time(f"loss curves: {workload.name}"):
            continue
        common = {"workload": workload.name, "shape": workload.shape,
                  "optimizer": config.loss_optimizer, "learning_rate": 1e-3}
        if progress:
            print(f"loss curves: {workload.name}, baseline", file=sys.stderr, flush=True)
        baseline = train_losses("baseline", workload, config.loss_optimizer,
                                config.loss_steps, 1e-3)
        for mode in config.loss_curves:
            if progress:
                print(f"loss curves: {workload.name}, {mode}", file=sys.stderr, flush=True)
            try:
                losses = train_losses(mode, workload, config.loss_optimizer,
                                      config.loss_steps, 1e-3)
            except Exception as e:  # noqa: BLE001 - reported in the results
                results.append({**common, "mode": mode,
                                "error": f"{type(e).__name__}: {e}".split("\n")[0][:500]})
                continue
            results.append({**common, **compare(mode, baseline, losses)})
    return results

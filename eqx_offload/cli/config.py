"""What one benchmark run measures (`BenchConfig`): the configuration that `bench` runs
and `losscurves` reads, in a module of its own so that neither imports the other."""

import dataclasses
from typing import Any, Optional

from .models import LMShape, lm_workload, mlp_workload, Workload
from .modes import DEFAULT_MODES


WORKLOADS = ("mlp", "transformer")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run measures.

    `sizes` are the MLP's parameter counts; `lm` sizes the transformer (one point per
    optimizer of `lm_optimizers`, default `optimizers`). Workloads run in the order of
    `workloads`. `loss_curves` names the modes whose loss curve is compared with the
    baseline's over `loss_steps` steps of `loss_optimizer`. Once `time_limit` seconds
    have passed, the points and loss curves not started yet are skipped (and listed),
    so that a run on a rented machine ends with every file written."""

    sizes: tuple[float, ...]
    lm: LMShape = LMShape()
    workloads: tuple[str, ...] = WORKLOADS
    optimizers: tuple[str, ...] = ("adam", "adafactor")
    lm_optimizers: Optional[tuple[str, ...]] = None
    modes: tuple[str, ...] = DEFAULT_MODES
    repeats: int = 13
    warmup: int = 2
    batch: int = 32
    mover_mib: tuple[int, ...] = (1, 4, 16, 64, 256)
    mover_repeats: int = 15
    loss_curves: tuple[str, ...] = ()
    loss_steps: int = 100
    loss_optimizer: str = "adam"
    target_min_params: float = 30e6
    time_limit: Optional[float] = None
    is_quick: bool = False
    plan_targets: tuple[str, ...] = ()  # GPU targets to plan every point for (gpu_plan)

    @staticmethod
    def full() -> "BenchConfig":
        return BenchConfig(sizes=(1e6, 3e6, 1e7, 3.2e7, 1e8))

    @staticmethod
    def quick() -> "BenchConfig":
        """A smoke test: one small MLP with Adam in every default mode, three timed
        steps, one mover size. The transformer (`--workloads transformer`, whose five
        compilations cost most of a quick run) and Adafactor are there for the asking."""
        return BenchConfig(sizes=(2e4,), lm=LMShape(vocab=64, width=32, layers=1, heads=2,
                                                    seq=16, batch=4),
                           workloads=("mlp",), optimizers=("adam",), lm_optimizers=("adam",),
                           repeats=3, warmup=1, batch=8, mover_mib=(1,), mover_repeats=3,
                           loss_steps=8, is_quick=True)

    def replace(self, **changes: Any) -> "BenchConfig":
        return dataclasses.replace(self, **changes)

    def workload_list(self) -> list[Workload]:
        """The benchmark's workloads in the order of `workloads`: every MLP size, the LM."""
        points: list[Any] = []
        for name in self.workloads:
            if name == "mlp":
                points += [mlp_workload(n, self.batch) for n in self.sizes]
            elif name == "transformer":
                points.append(lm_workload(self.lm))
        return points

    def optimizers_for(self, workload: Workload) -> tuple[str, ...]:
        """The optimizers `workload` is measured with."""
        if workload.name == "transformer" and self.lm_optimizers is not None:
            return self.lm_optimizers
        return self.optimizers

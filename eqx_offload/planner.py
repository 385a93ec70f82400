"""The planner: XLA's plan of a training step for a GPU or a TPU, compiled on this
machine without one (`plan`, and `gpu_plan`: `plan` with an H200 by default; docs:
"The plan"), and of the start-up that makes the
model and its state (`plan_startup`).

`from eqx_offload.planner import plan, TPU_TARGETS`.
"""

from ._plan.hlo import PlannedCollective as PlannedCollective, PlannedCopy as PlannedCopy
from ._plan.plan import gpu_plan as gpu_plan, plan as plan
from ._plan.result import Plan as Plan
from ._plan.startup import (
    plan_startup as plan_startup,
    RUNTIME_HOST_BYTES as RUNTIME_HOST_BYTES,
    StartupPlan as StartupPlan,
)
from ._plan.targets import (
    GPU_TARGETS as GPU_TARGETS,
    GpuTarget as GpuTarget,
    TPU_TARGETS as TPU_TARGETS,
    TpuTarget as TpuTarget,
)


__all__ = [
    "GPU_TARGETS",
    "GpuTarget",
    "gpu_plan",
    "Plan",
    "plan",
    "PlannedCollective",
    "PlannedCopy",
    "plan_startup",
    "RUNTIME_HOST_BYTES",
    "StartupPlan",
    "TPU_TARGETS",
    "TpuTarget",
]

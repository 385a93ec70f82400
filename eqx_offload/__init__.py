"""eqx_offload: keep optimizer state in host memory between steps.

Pure-function combinators for JAX, Equinox and Optax: `to_host`, `to_device`,
`offloaded`, `filter_jit` (and `jit`, for `jax.jit` programs), `memory_report`; inside models: `scan_layers`,
`host_weights`, `master_weights`, `filter_remat` and the offloading remat policies.
"""

import importlib.metadata

from ._optim.budget import prefetch_options as prefetch_options, within_budget as within_budget
from ._core.checkpoint import (
    abstract_init as abstract_init,
    deserialise_filter_spec as deserialise_filter_spec,
    filter_eval_shape as filter_eval_shape,
    host_shardings as host_shardings,
    restore_target as restore_target,
    tree_deserialise_leaves as tree_deserialise_leaves,
)
from ._core.errors import (
    CheckpointError as CheckpointError,
    CompositionError as CompositionError,
    DonationError as DonationError,
    MemoryKindError as MemoryKindError,
    NotATransformationError as NotATransformationError,
    OffloadError as OffloadError,
    OptionError as OptionError,
    PlanError as PlanError,
    SignatureError as SignatureError,
    StateError as StateError,
    TracedMoveError as TracedMoveError,
    TreeError as TreeError,
    WhereError as WhereError,
)
from ._jit.jax_jit import jit as jit
from ._jit.jit import Compiled as Compiled, filter_jit as filter_jit, Lowered as Lowered
from ._jit.nnx_jit import nnx_jit as nnx_jit
from ._models.master import (
    master_weights as master_weights,
    MasterState as MasterState,
    MasterWeights as MasterWeights,
)
from ._core.memory import supported_memory_kinds as supported_memory_kinds
from ._core.move import filter_shard as filter_shard, to_device as to_device, to_host as to_host
from ._optim.offloaded import offloaded as offloaded
from ._optim.options import Compute as Compute
from ._models.params import (
    apply_updates as apply_updates,
    host_weights as host_weights,
    HostWeights as HostWeights,
    host_params as host_params,
    HostParams as HostParams,
    with_host_params as with_host_params,
)
from ._plan.hlo import PlannedCollective as PlannedCollective, PlannedCopy as PlannedCopy
from ._plan.plan import gpu_plan as gpu_plan, GpuPlan as GpuPlan, plan as plan
from ._plan.targets import GPU_TARGETS as GPU_TARGETS, GpuTarget as GpuTarget
from ._models.remat import (
    filter_remat as filter_remat,
    LAYER_INPUT as LAYER_INPUT,
    offload_dots as offload_dots,
    offload_names as offload_names,
    offload_regex as offload_regex,
    Policy as Policy,
)
from ._core.report import (
    LeafMemory as LeafMemory,
    memory_report as memory_report,
    MemoryReport as MemoryReport,
)
from ._models.scan import scan_layers as scan_layers
from ._optim.schedule import StreamPlan as StreamPlan
from ._optim.state import OffloadedState as OffloadedState, OffloadWarning as OffloadWarning
from ._optim.stream import stream_plan as stream_plan
from ._runtime import install_runtime_checks as install_runtime_checks
from ._core.types import (
    Donate as Donate,
    HostMemoryKind as HostMemoryKind,
    MemoryKind as MemoryKind,
    Nested as Nested,
    Where as Where,
)
from ._core.where import (
    Filter as Filter,
    min_bytes as min_bytes,
    min_ndim as min_ndim,
    pattern as pattern,
)


try:
    __version__ = importlib.metadata.version("eqx_offload")
except importlib.metadata.PackageNotFoundError:  # a source tree on `PYTHONPATH`, not installed
    __version__ = "0+unknown"

# The public names (what `mypy.stubtest` holds the shipped stub to, see scripts/gates.sh).
__all__ = [
    "abstract_init",
    "apply_updates",
    "CheckpointError",
    "Compiled",
    "CompositionError",
    "DonationError",
    "Compute",
    "deserialise_filter_spec",
    "Donate",
    "Filter",
    "filter_eval_shape",
    "filter_jit",
    "filter_remat",
    "filter_shard",
    "gpu_plan",
    "GPU_TARGETS",
    "GpuPlan",
    "GpuTarget",
    "host_params",
    "host_shardings",
    "host_weights",
    "HostMemoryKind",
    "HostParams",
    "HostWeights",
    "install_runtime_checks",
    "jit",
    "LAYER_INPUT",
    "LeafMemory",
    "Lowered",
    "master_weights",
    "MasterState",
    "MasterWeights",
    "memory_report",
    "MemoryKind",
    "MemoryKindError",
    "MemoryReport",
    "min_bytes",
    "min_ndim",
    "Nested",
    "nnx_jit",
    "NotATransformationError",
    "offload_dots",
    "offload_names",
    "offload_regex",
    "offloaded",
    "OffloadedState",
    "OffloadError",
    "OffloadWarning",
    "OptionError",
    "pattern",
    "plan",
    "PlanError",
    "PlannedCollective",
    "PlannedCopy",
    "Policy",
    "prefetch_options",
    "restore_target",
    "scan_layers",
    "SignatureError",
    "StateError",
    "stream_plan",
    "StreamPlan",
    "supported_memory_kinds",
    "to_device",
    "to_host",
    "tree_deserialise_leaves",
    "TracedMoveError",
    "TreeError",
    "Where",
    "WhereError",
    "with_host_params",
    "within_budget",
]

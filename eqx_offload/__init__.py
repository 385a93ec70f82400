"""eqx_offload: keep optimizer state in host memory between steps.

Pure-function combinators for JAX, Equinox and Optax: `to_host`, `to_device`,
`offloaded`, `filter_jit` (and `jit`, `nnx_jit`), `memory_report`; inside models:
`scan_layers`, `host_weights`, `host_weights_optimizer`, `master_weights`, `filter_remat`,
`update_in_backward`.
The rest is in submodules: `errors`, `checkpoint`, `remat` (the offloading policies),
`stream` (the streamed update's plan and options), `memory`, `planner` (`plan`'s
targets and results), `types`.
"""

import importlib.metadata
import typing
from types import FrameType as _FrameType

from . import checkpoint as checkpoint, errors as errors, memory as memory, remat as remat
from . import planner as planner, stream as stream, types as types
from ._core.compat import caller_imports_from as _caller_imports_from
from ._core.errors import OffloadError as OffloadError
from ._core.move import filter_shard as filter_shard, to_device as to_device, to_host as to_host
from ._report import memory_report as memory_report
from ._core.types import Nested as Nested
from ._core.where import min_bytes as min_bytes, min_ndim as min_ndim, pattern as pattern
from ._jit.jax_jit import jit as jit
from ._jit.jit import filter_jit as filter_jit
from ._jit.nnx_jit import nnx_jit as nnx_jit
from ._models.backward import update_in_backward as update_in_backward
from ._models.make import filter_make as filter_make, stack_layers as stack_layers
from ._models.master import master_weights as master_weights
from ._models.params import (
    apply_updates as apply_updates,
    host_weights as host_weights,
    host_weights_optimizer as host_weights_optimizer,
)
from ._models.remat import filter_remat as filter_remat
from ._models.scan import scan_layers as scan_layers
from ._optim.offloaded import offloaded as offloaded
from ._optim.state import OffloadedState as OffloadedState
from ._plan.plan import plan as plan
from ._runtime import install_runtime_checks as install_runtime_checks


try:
    __version__ = importlib.metadata.version("eqx_offload")
except importlib.metadata.PackageNotFoundError:  # a source tree on `PYTHONPATH`, not installed
    __version__ = "0+unknown"

# The public names (what `mypy.stubtest` holds the shipped stub to, see scripts/gates.sh);
# the rest is in the submodules above.
__all__ = [
    "apply_updates",
    "filter_jit",
    "filter_make",
    "filter_remat",
    "filter_shard",
    "host_weights",
    "host_weights_optimizer",
    "install_runtime_checks",
    "jit",
    "master_weights",
    "memory_report",
    "min_bytes",
    "min_ndim",
    "Nested",
    "nnx_jit",
    "offloaded",
    "OffloadedState",
    "OffloadError",
    "pattern",
    "plan",
    "scan_layers",
    "stack_layers",
    "to_device",
    "to_host",
    "update_in_backward",
]

# Where each name that left the top level lives now: an `AttributeError` names it. (Not
# seen by the static checkers, for which a misspelt name stays an error.)
_MOVED = {name: f"{module.__name__}.{name}"
          for module in (checkpoint, errors, memory, planner, remat, stream, types)
          for name in module.__all__
          if name not in __all__}
_MOVED.update(host_params="eqx_offload.host_weights_optimizer",
              HostParams="eqx_offload.types.HostWeightsOptimizer",
              GpuPlan="eqx_offload.planner.Plan",
              with_host_params="eqx_offload.host_weights_optimizer")


def _passed(frame: _FrameType) -> bool:
    """Whether `frame` is this file's or that of a type checker that may wrap
    `__getattr__` (jaxtyping's import hook, through beartype): not the importer."""
    return (frame.f_code.co_filename == __file__
            or frame.f_globals.get("__name__", "").startswith(("beartype", "jaxtyping"))
            or frame.f_code.co_filename.startswith("<@beartype"))


if not typing.TYPE_CHECKING:
    def __getattr__(name: str) -> object:
        if name in _MOVED:
            message = (f"Use {_MOVED[name]}: eqx_offload.{name} moved there "
                       "(https://eqx-offload.readthedocs.io/en/latest/changelog/).")
            if _caller_imports_from(_passed):  # `from eqx_offload import name`
                raise ImportError(message, name="eqx_offload")
            raise AttributeError(message)
        raise AttributeError(f"module 'eqx_offload' has no attribute {name!r}")

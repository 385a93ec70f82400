"""Compiling for an NVIDIA GPU without one, for `plan` (its one private JAX call,
`compat.compile_for_devices`, is pinned by tests/upstream/test_upstream_deviceless.py).

XLA's GPU compiler runs on any machine once `jax-cuda12-plugin` (at the installed JAX
version) and a `ptxas` (the `nvidia-cuda-nvcc-cu12` wheel) are installed. A compile-only
client for a described GPU comes from `jax.experimental.topologies.get_topology_desc`;
its devices have no memories, so a sharding on them drops `pinned_host`. The step is
therefore lowered with ordinary CPU shardings (which keep memory kinds) for the `cuda`
platform, and the StableHLO module is compiled with the compile-only client (as JAX's own
`tests/deviceless_aot_test.py` compiles for a topology).
"""

import collections
import functools
import hashlib
import importlib.metadata
import os
from typing import Any

from .._core import compat
from .._core.errors import PlanError
from .._core.memory import host_pool_limit


def _install_hint() -> str:
    version = importlib.metadata.version("jax")
    return (
        "Install the GPU compiler (no GPU, driver, cuDNN or cuBLAS is needed): "
        f"`pip install 'jax-cuda12-plugin=={version}' nvidia-cuda-nvcc-cu12` "
        "(the plugin must match the installed JAX exactly; `pip install "
        "'eqx_offload[plan]'` brings both, and then needs the same pin if your JAX "
        "is not the newest), and run with JAX_PLATFORMS=cpu on a machine without a GPU."
    )


def check_available() -> None:
    """Raise a `PlanError` naming the fix unless the GPU compiler can be used."""
    try:
        plugin = importlib.metadata.version("jax-cuda12-plugin")
    except importlib.metadata.PackageNotFoundError:
        raise PlanError("plan: jax-cuda12-plugin is not installed. " + _install_hint()) from None
    jax_version = importlib.metadata.version("jax")
    if plugin != jax_version:
        raise PlanError(
            f"plan: jax-cuda12-plugin {plugin} does not match jax {jax_version}. "
            + _install_hint()
        )


@functools.lru_cache(maxsize=None)
def topology(target_config: str, n_devices: int) -> Any:
    """A compile-only topology of `n_devices` GPUs described by `target_config` (a
    `stream_executor.GpuTargetConfigProto` in text form)."""
    from jax.experimental import topologies

    check_available()
    try:
        return topologies.get_topology_desc(
            platform="cuda", target_config=target_config, topology=f"1x1x{n_devices}"
        )
    except Exception as error:  # the plugin's own failure, e.g. no ptxas
        raise PlanError(f"plan: XLA could not describe the GPU ({error}). "
                        + _install_hint()) from error


# The executables `compile_for` made last, by what was compiled: the same module with the
# same options for the same devices is the same executable (XLA's compile is
# deterministic), and a GPU compile takes seconds (a plan compared with the plain step's
# plan, a search that plans a point twice). Only read from (memory statistics, HLO text).
_COMPILED: "collections.OrderedDict[str, Any]" = collections.OrderedDict()
_COMPILED_MAX = 16


def compile_for(lowered: Any, devices: list[Any], compiler_options: dict[str, Any]) -> Any:
    """Compile a `jax.stages.Lowered` (lowered for `cuda`) for compile-only `devices`.
    Returns XLA's executable: `get_compiled_memory_stats()`, `as_text()`. The last 16
    are kept, by module text, options and devices: compiling one of them again returns
    it."""
    module = lowered.compiler_ir("stablehlo")
    key = hashlib.sha256("\n".join([
        # (Without source locations: XLA keeps them as metadata, which neither its
        # schedule nor the plan reads.)
        str(module), repr(sorted(compiler_options.items())),
        repr([(id(d.client), d.id) for d in devices])]).encode()).hexdigest()
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
    executable = _compile(module, devices, compiler_options)
    _COMPILED[key] = executable
    if len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    return executable


# XLA's GPU autotuner cannot profile without a GPU: for a deviceless target it gives each
# matrix product and fusion its default configuration. At a level above 0 (XLA's default
# is 4) it first compiles candidate kernels of the fusions all the same (ptxas, for
# nothing it can time): a quarter to a third of a small step's plan, a few seconds of a
# large one's. At level 0 it skips that, and the compiled program is the same: identical
# optimized HLO (fusions, schedule, buffers) but for the autotuner's note that a fusion
# keeps its default emitter (tests/upstream/test_upstream_deviceless.py pins it; the same
# HLO for Llama steps of 0.01B and 1B parameters, the same plan for 8B). A level set in
# the options or in XLA_FLAGS is kept.
AUTOTUNE_LEVEL = "xla_gpu_autotune_level"


def deviceless_options(compiler_options: dict[str, Any]) -> dict[str, Any]:
    """`compiler_options` for a compile-only GPU: with `xla_gpu_autotune_level=0` unless
    they or XLA_FLAGS set a level (see `AUTOTUNE_LEVEL`)."""
    options = dict(compiler_options)
    if AUTOTUNE_LEVEL not in options and AUTOTUNE_LEVEL not in os.environ.get("XLA_FLAGS", ""):
        options[AUTOTUNE_LEVEL] = 0
    return options


def _compile(module: Any, devices: list[Any], compiler_options: dict[str, Any]) -> Any:
    return compat.compile_for_devices(module, devices, deviceless_options(compiler_options))


def host_pool_limit_bytes() -> int:
    """The cap on XLA's pinned host allocator on CUDA (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`,
    64 GB when unset): `pinned_host` arrays beyond it fail to allocate. Read as XLA
    reads it, by the one reader init's check and the restores use
    (`memory.host_pool_limit`)."""
    limit = host_pool_limit("cuda")
    assert limit is not None  # CUDA always has the pool
    return limit

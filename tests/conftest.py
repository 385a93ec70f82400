import importlib.metadata
import os
import re
import shutil
import tempfile

# The CPU backend, also where jax-cuda12-plugin (for gpu_plan) is installed: JAX would
# try CUDA first and report a failed start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# LLVM at -O1 (XLA's default is -O3) unless XLA_FLAGS sets a level: XLA compiles are
# most of the suite's CPU time, and what the tests check is decided in XLA's HLO passes
# before LLVM; the numbers are bitwise those of -O3 up to JAX 0.12.0.1
# (`upstream/test_upstream_llvm_level.py`); from JAX 0.12.1, where they are not, the
# suite runs at the default level. Child processes inherit it. Two programs of other
# shapes can still round otherwise at -O1 alone: tests comparing such programs' bits run
# them at the default level (`models/test_backward_programs.py`'s `_at_default_level`).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "") and tuple(
        int(part) for part in re.findall(r"\d+", importlib.metadata.version("jax"))[:3]) < (0, 12, 1):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=1"
    os.environ["XLA_FLAGS"] = flags.strip()

import jax
import pytest


# The accelerator tier runs on an accelerator only, by its own command
# (`bash scripts/check.sh accelerator`).
collect_ignore = ["accelerator"]


# 8 CPU devices for the multi-device tests (before any backend starts); the default is CPU 0.
jax.config.update("jax_num_cpu_devices", 8)

# JAX's persistent compilation cache, one folder for this run, shared by the xdist
# workers, the optax suite's children and `isolated.py`'s (a hit is the identical
# module's executable, still reported as a compilation); the process that starts the run
# makes and removes it.
# JAX writes an entry in place: a process that reads one another is still writing fails
# to decompress it, warns (pyproject.toml lets that warning pass) and compiles.
CACHE_VARIABLE = "EQX_OFFLOAD_TEST_JAX_CACHE"
_MADE_CACHE = CACHE_VARIABLE not in os.environ
if _MADE_CACHE:
    os.environ[CACHE_VARIABLE] = tempfile.mkdtemp(prefix="eqx-offload-jax-cache-")
jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_VARIABLE])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config: pytest.Config) -> None:
    # xdist's `load` scheduler (`-n N`) hands each worker a run of consecutive tests, up to
    # a sixth of those pending: with the long tests first (below), one run held most of
    # them, and that worker compiled for minutes after the others had finished. At most
    # 16 at a time, the long tests spread over the workers, and a module's cases still
    # mostly share one. `--maxschedchunk=N` sets another number.
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 16


def pytest_unconfigure(config: pytest.Config) -> None:
    if _MADE_CACHE:
        shutil.rmtree(os.environ.pop(CACHE_VARIABLE), ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The canaries of tests/upstream/ run in both environments (`both`).
    for item in items:
        if item.path.parent.name == "upstream" and item.get_closest_marker("once") is None:
            item.add_marker(pytest.mark.both)
    # The long tests (`slow`) first, in their collected order, so `pytest -n 2` does not
    # leave one worker with a long test at the end while the other idles.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

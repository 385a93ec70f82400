import os

# The CPU backend, also where the GPU compiler (jax-cuda12-plugin, for gpu_plan) is
# installed: without a GPU, JAX would try CUDA first and report a failed start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# LLVM at -O1 for the run's compiles (XLA's default is -O3), unless XLA_FLAGS already
# sets a level (`XLA_FLAGS=--xla_backend_optimization_level=3 pytest ...` checks at
# the default). XLA compiles are most of the suite's CPU time and the programs are
# tiny: -O1 compiles them in about a fifth less CPU (the oldest environment's pytest:
# 783 against 963 CPU-s, measured on this kind of machine). What the tests check is
# decided before LLVM, in XLA's HLO passes (memory kinds, donation and aliasing, fusion,
# the GPU plan's buffers and schedule: the plan's JSON is identical), and the numbers do
# not move: 20 AdamW steps of an MLP with attention give bitwise the same parameters at
# -O1 as at -O3 in both environments (not at -O0, hence not -O0).
# Child processes (the optax suite, the command line, donation harnesses) inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=1"
    ).strip()

import shutil
import tempfile

import jax
import pytest


# 8 CPU devices for the multi-device tests; the default device stays CPU 0. Must run
# before any backend is initialised.
jax.config.update("jax_num_cpu_devices", 8)

# JAX's persistent compilation cache, one for the whole run: about a third of the
# compilations of the library's tests are of a module compiled before (the same step for
# the unwrapped and the wrapped optimizer, eager optax `lax.cond`s, ...), and XLA compile
# is most of the suite's CPU time. A hit is the executable of the identical module (same
# HLO, options and flags), so every program runs the code it would have run; JAX still
# reports a hit as a compilation (`tests/helpers.count_compiles`). The process that
# starts the run makes the folder (the xdist workers inherit the variable) and removes it
# at the end: nothing carries over between runs. Each process has a subfolder of its own
# (`jax.config.jax_compilation_cache_dir`, which the optax suite's children reuse, one at
# a time): JAX writes an entry in place, without a lock unless eviction is on, so a
# worker reading the entry another is writing got a truncated file (CI, 2026-12-02:
# "Error reading persistent compilation cache entry", an error under
# `filterwarnings = error`).
CACHE_VARIABLE = "EQX_OFFLOAD_TEST_JAX_CACHE"
_MADE_CACHE = CACHE_VARIABLE not in os.environ
if _MADE_CACHE:
    os.environ[CACHE_VARIABLE] = tempfile.mkdtemp(prefix="eqx-offload-jax-cache-")
jax.config.update(
    "jax_compilation_cache_dir",
    os.path.join(os.environ[CACHE_VARIABLE], os.environ.get("PYTEST_XDIST_WORKER", "main")),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _MADE_CACHE:
        shutil.rmtree(os.environ.pop(CACHE_VARIABLE), ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The canaries of tests/upstream/ pin JAX behaviour the package works around: they
    # run in both environments (`both`), as the test files that mark themselves do.
    for item in items:
        if item.path.parent.name == "upstream" and item.get_closest_marker("once") is None:
            item.add_marker(pytest.mark.both)
    # The long tests (`slow`) first, in their collected order: `pytest -n 2` hands them
    # out while the queue is long, so no worker is left with one long test at the end
    # while the other idles.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

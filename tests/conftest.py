import os

# The CPU backend, also where the GPU compiler (jax-cuda12-plugin, for gpu_plan) is
# installed: without a GPU, JAX would try CUDA first and report a failed start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest


# 8 CPU devices for the multi-device tests; the default device stays CPU 0. Must run
# before any backend is initialised.
jax.config.update("jax_num_cpu_devices", 8)


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

"""The TPU tier: training steps compiled for a TPU v5e on a machine without one.

libtpu (`pip install "jax[tpu]==<jax version>"`) compiles for a TPU it describes: a
topology from `jax.experimental.topologies.get_topology_desc` has compile-only TPU
devices with `device`, `pinned_host` and `unpinned_host` memories, so a step lowered with
shardings on one keeps its memory kinds, and XLA:TPU compiles it and reports its memory
analysis. The tests run with `JAX_PLATFORMS=cpu` beside the CPU tests: loading the
plugin for a topology starts no TPU backend, and the CPU stays JAX's default. Without
libtpu every test of the tier skips, naming the JAX version whose libtpu is missing and
the install (a JAX release can come before its libtpu)."""

import pathlib
from typing import Any

import pytest
from helpers import tpu_plan_marks, v5e


@pytest.hookimpl(tryfirst=True)  # (before tests/conftest.py's, which runs `slow` first)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # (A conftest's hook sees every collected item: this folder's are the tier's.) Every
    # test of the tier is `slow`: its XLA:TPU compiles (most in a child process) take
    # minutes, and run first, beside the other long tests, not at the end of the run
    # where one worker would compile alone while the others idle.
    for item in items:
        if item.path.parent == pathlib.Path(__file__).parent:
            for mark in [pytest.mark.slow, *tpu_plan_marks()]:
                item.add_marker(mark)


@pytest.fixture(scope="session")
def tpu() -> Any:
    """The first device of a TPU v5e topology (`helpers.v5e`)."""
    return v5e()

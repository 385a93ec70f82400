"""The TPU tier: training steps compiled for a TPU v5e on a machine without one.

libtpu (`pip install "jax[tpu]==<jax version>"`) compiles for a TPU it describes: a
topology from `jax.experimental.topologies.get_topology_desc` has compile-only TPU
devices with `device`, `pinned_host` and `unpinned_host` memories, so a step lowered with
shardings on one keeps its memory kinds, and XLA:TPU compiles it and reports its memory
analysis. The tests run with `JAX_PLATFORMS=cpu` beside the CPU tests: loading the
plugin for a topology starts no TPU backend, and the CPU stays JAX's default. Without
libtpu every test of the tier fails, naming the install."""

from typing import Any

import pytest
from helpers import v5e


@pytest.fixture(scope="session")
def tpu() -> Any:
    """The first device of a TPU v5e topology (`helpers.v5e`)."""
    return v5e()

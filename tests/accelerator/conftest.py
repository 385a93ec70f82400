"""The accelerator tier: claims only an accelerator can show. Run on a machine with one
(`bash scripts/check.sh accelerator`), never by the CPU suite (`tests/conftest.py` leaves
this folder out, and this tier runs with `--confcutdir` so that conftest's CPU settings
stay out of it). On the CPU every test here fails: none is skipped."""

import json
import os
import subprocess
import sys
from typing import Any

import jax
import pytest


WORKER = os.path.join(os.path.dirname(__file__), "worker.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The tests that run a process of their own go first: the chip takes one process at
    # a time, and this one holds it from its first in-process test on.
    items.sort(key=lambda item: item.get_closest_marker("own_process") is None)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "own_process: runs its program in a child process")


@pytest.fixture
def accelerator() -> str:
    """The default backend, which must not be the CPU."""
    backend = jax.default_backend()
    if backend == "cpu":
        pytest.fail("the accelerator tier needs an accelerator; JAX's default backend is "
                    "the CPU (is JAX_PLATFORMS=cpu set?)")
    return backend


def run_worker(mode: str, width: int, depth: int, steps: int) -> dict[str, Any]:
    """`worker.py`'s result for one run, in a child process."""
    done = subprocess.run([sys.executable, WORKER, mode, str(width), str(depth), str(steps)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] != "cpu", "the accelerator tier ran on the CPU"
    return result

"""The README's "Training step" example is the recommended pattern, complete and
runnable: it runs (in a fresh process, as it donates host-resident state), and it is
the same code as `docs/examples/training_step.py`."""

import os
import pathlib
import re
import subprocess
import sys

import pytest


# The README is checked in one environment (scripts/check.sh: the newest).
pytestmark = pytest.mark.once

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "training_step.py"


def training_step_blocks() -> list[str]:
    """The `python` code blocks of README.md's "## Training step" section."""
    text = (ROOT / "README.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    [section] = [s for s in sections if s.startswith("Training step\n")]
    return re.findall(r"^```python\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def test_readme_has_the_training_step():
    blocks = training_step_blocks()
    assert len(blocks) == 1
    code = blocks[0]
    # The recommended pattern, not a variant of it.
    assert "eqx_offload.offloaded(optax.adamw(" in code
    assert '@eqx_offload.filter_jit(donate="all")' in code
    assert 'sharding.memory_kind == "pinned_host"' in code


def test_readme_training_step_is_the_example_file():
    assert training_step_blocks()[0] == EXAMPLE.read_text()


@pytest.mark.slow
def test_readme_training_step_runs():
    process = _run("\n".join(training_step_blocks()))
    assert process.returncode == 0, process.stderr[-6000:]
    assert "pinned_host" in process.stdout  # the memory report it prints


@pytest.mark.slow
def test_example_file_runs():
    process = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE)], capture_output=True, text=True,
        timeout=600, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert process.returncode == 0, process.stderr[-6000:]
    assert "pinned_host" in process.stdout

"""The README: its "Training step" example is the recommended pattern, is the example file
and runs; it keeps a front page's shape (short, code early, the CI command, accelerator rows)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest


pytestmark = pytest.mark.once

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "training_step.py"


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    [section] = [s for s in re.split(r"^## ", text, flags=re.MULTILINE)
                 if s.startswith(f"{title}\n")]
    return section


def training_step_blocks() -> list[str]:
    """The `python` code blocks of README.md's "## Training step" section."""
    return re.findall(r"^```python\n(.*?)^```", _section("Training step"),
                      flags=re.MULTILINE | re.DOTALL)


def test_readme_has_the_training_step_of_the_example_file():
    [code] = training_step_blocks()
    assert "eqx_offload.offloaded(optax.adamw(" in code
    assert '@eqx_offload.filter_jit(donate="all")' in code
    assert 'sharding.memory_kind == "pinned_host"' in code
    assert code == EXAMPLE.read_text()


@pytest.mark.slow
def test_example_file_runs():
    """In a fresh process (it donates host-resident state); the README's block is this file."""
    process = subprocess.run([sys.executable, "-W", "error", str(EXAMPLE)], capture_output=True,
                             text=True, timeout=600, cwd=ROOT,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert process.returncode == 0, process.stderr[-6000:]
    assert "pinned_host" in process.stdout  # the memory report it prints


def test_readme_is_a_front_page():
    """Short, code early, the demo and CI commands, accelerator rows that say measured or plan."""
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 1000
    assert len(text[:text.index("```")].split()) <= 300  # code within the first 300 words
    for name in ("master_weights", "host_weights", "scan_layers", "CHANGELOG.md"):
        assert name in text, name
    assert (ROOT / "CHANGELOG.md").is_file()
    section = _section("Quickstart")
    # the demo from a fresh clone, and the command CI runs (.ci/run execs it)
    assert ('python3 -m venv .venv && .venv/bin/pip install -q -e ".[cli]" && '
            ".venv/bin/python -m eqx_offload demo") in section
    assert "\nbash scripts/check.sh\n" in section and "bash scripts/check.sh fast" in section
    assert "exec bash scripts/check.sh\n" in (ROOT / ".ci" / "run").read_text()
    header, *body = [line for line in _section("On an accelerator").splitlines()
                     if line.startswith("|") and not line.startswith("| ---")]
    assert header.rstrip(" |").endswith("kind") and len(body) >= 3
    for row in body:
        assert row.rstrip(" |").rsplit("|", 1)[-1].strip() in ("measured", "plan"), row

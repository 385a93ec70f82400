"""The chip's probe of both copy directions in a loop (`bench/results/tpu-v5e-2026-12-06c/duplex_loop.py`) at a
tiny size on the CPU: every form and program runs, writes its host outputs in place, and
makes a JSON row."""

import json
import os
import pathlib
import subprocess
import sys

import pytest


pytestmark = pytest.mark.once  # (a script of the repository)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_probe_runs_every_form_at_a_tiny_size() -> None:
    done = subprocess.run(
        [sys.executable, "bench/results/tpu-v5e-2026-12-06c/duplex_loop.py", "--total-mib", "0.5", "--copy-mib",
         "0.125", "--per-iter", "1,2", "--reps", "2"],
        cwd=ROOT, check=True, timeout=600, capture_output=True, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    rows = [json.loads(line.removeprefix("RESULT "))
            for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert [(r["form"], r["per_iter"]) for r in rows] == [
        (form, k) for form in ("fori", "fenced", "unrolled") for k in (1, 2)]
    for r in rows:
        assert r["written"] and r["mib_each_way"] == 0.5 and r["iterations"] * r["per_iter"] == 4
        assert all(r[f"{p}_ms"] > 0 for p in ("h2d", "d2h", "both", "update"))
        assert set(r["in_flight"]) == {"h2d", "d2h", "both", "update"}

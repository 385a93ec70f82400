"""The chip's script (`bench/tpu/next.sh`) at the small size it runs on the CPU: every
script its rows call, and every mode of them, makes a JSON row without an error, and the
guard stops a row when the host's available memory runs low."""

import json
import os
import pathlib
import subprocess
import sys

import pytest


pytestmark = pytest.mark.once  # (scripts of the repository, as the GPU-plan ones)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _next(call: str, tmp_path: pathlib.Path, **env: str) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["bash", "bench/tpu/next.sh", call], cwd=ROOT, check=True, timeout=1500,
                   env={**os.environ, "SIZE": "small", "OUT": str(out),
                        "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu", **env})
    return [json.loads(line) for f in sorted(out.glob("*.jsonl"))
            for line in f.read_text().splitlines()]


def test_the_first_call_runs_every_row_at_a_small_size(tmp_path: pathlib.Path) -> None:
    rows = _next("1", tmp_path)
    modes = [r["mode"] for r in rows]
    assert modes == ["fp32", "state", "state-backward", "state-int8state", "+activations",
                     "+activations-backward"]
    for row in rows:
        assert "error" not in row, row
        assert len(row["losses"]) == 2 and row["startup_s"] > 0
    # the modes store what they say: the state (and more) in host memory but for plain
    assert [("pinned_host" in r["stored"]) for r in rows] == [False] + [True] * 5
    # the update in the backward pass: the normal step's losses, bitwise on the CPU
    assert rows[2]["losses"] == rows[1]["losses"]
    assert rows[5]["losses"] == rows[4]["losses"]


def test_a_row_is_stopped_when_the_host_runs_low(tmp_path: pathlib.Path) -> None:
    rows = _next("4", tmp_path, FLOOR_GIB="100000")  # (no host has that much free)
    assert rows and all("stopped" in r.get("error", "") for r in rows)


@pytest.mark.parametrize("call", ["3", "5", "6", "9"])
def test_the_capacity_and_host_memory_calls_run_at_a_small_size(
        call: str, tmp_path: pathlib.Path) -> None:
    rows = _next(call, tmp_path)
    assert len(rows) == {"3": 2, "5": 3, "6": 3, "9": 2}[call]
    for row in rows:
        assert "error" not in row, row
        if "stages" in row:  # (host_rss.py: resident memory, stage by stage)
            assert row["stages"] and all(s["rss_gb"] >= 0 for s in row["stages"])
        else:
            assert len(row["losses"]) == (2 if "tokens_per_step" in row else 20)  # (throughput)

"""The chip's script (`bench/tpu/next.sh`): every row of every call names a script that
is there, with arguments its parser reads (at the chip's size); at the small size it runs
on the CPU, every script its rows call, and every mode of them, makes a JSON row without
an error; the guard stops a row when the host's available memory runs low."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import tpu_plan_marks

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import harness  # (bench/: scripts of the repository)
import train


pytestmark = pytest.mark.once  # (scripts of the repository, as the GPU-plan ones)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _next(call: str, tmp_path: pathlib.Path, **env: str) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["bash", "bench/tpu/next.sh", call], cwd=ROOT, check=True, timeout=1500,
                   env={**os.environ, "SIZE": "small", "OUT": str(out),
                        "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu", **env})
    return [{**json.loads(line), "file": f.stem} for f in sorted(out.glob("*.jsonl"))
            for line in f.read_text().splitlines()]


@pytest.mark.parametrize("size", ["chip", "small"])
def test_every_row_of_every_call_parses(size: str) -> None:
    listed = subprocess.run(["bash", "bench/tpu/next.sh", "all"], cwd=ROOT, check=True,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "DRY": "1", "SIZE": size})
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert len(rows) == 46, listed.stdout
    modes, firsts = set(), 0
    for script, *args in rows:
        assert (ROOT / script).is_file(), script
        if script == "bench/train.py":
            parsed = train.parse(args)
            modes.add(parsed.mode)
            assert len(parsed.numbers) == 5 and parsed.file in ("throughput", "capacity")
            firsts += parsed.compile_first
        elif script == "bench/host_rss.py" and args[0] == "startup":
            modes.add(args[1])
            assert len(args) == 5 and harness.mode_of(args[1])
    # the stored-once rows of calls 9 and 11 (8-bit and fp32 moments) among them, and
    # call 17's step compiled by a process of its own
    assert {"+activations-once-int8state-backward", "+params-once-int8state-backward",
            "+activations-once-backward",
            "state-int8state-backward", "+activations-bf16state"} <= modes and firsts == 1
    with pytest.raises(SystemExit):  # (a mode the harness does not know fails to parse)
        train.parse(["+activations-int4state", "128", "2"])


def test_the_first_call_runs_every_row_at_a_small_size(tmp_path: pathlib.Path) -> None:
    rows = _next("1", tmp_path)
    modes = [r["mode"] for r in rows]
    assert modes == ["fp32", "state", "state-backward", "state-int8state", "+activations",
                     "+activations-backward"]
    for row in rows:
        assert "error" not in row, row
        assert len(row["losses"]) == 2 and row["falls"] and row["startup_s"] > 0
        # compiled ahead, before the start-up: the steps run that executable, none other
        assert row["compiles_in_steps"] == 0 and row["compile_s"] > 0
        assert row["resident_before_compile"] <= row["resident_peak_compile"]
        assert row["resident_after_startup"] > 0 and row["resident_after_first_step"] > 0
    # the modes store what they say: the state (and more) in host memory but for plain;
    # with everything in host memory, more there than on the device
    assert [("pinned_host" in r["stored"]) for r in rows] == [False] + [True] * 5
    assert rows[4]["stored"]["pinned_host"] > rows[4]["stored"]["device"]
    # the update in the backward pass: the normal step's losses, bitwise on the CPU
    assert rows[2]["losses"] == rows[1]["losses"]
    assert rows[5]["losses"] == rows[4]["losses"]


def test_a_row_is_stopped_when_the_host_runs_low(tmp_path: pathlib.Path) -> None:
    rows = _next("17", tmp_path, FLOOR_GIB="100000")  # (no host has that much free)
    assert rows and all("stopped" in r.get("error", "") for r in rows)


@pytest.mark.parametrize("call", ["6", "9", "11", "13", "17"])
def test_the_capacity_start_up_and_host_memory_calls_run_at_a_small_size(
        call: str, tmp_path: pathlib.Path) -> None:
    rows = _next(call, tmp_path)
    assert len(rows) == {"6": 3, "9": 2, "11": 1, "13": 1, "17": 12}[call]
    for row in rows:
        assert "error" not in row, row
        if row["file"] == "zeros_rss":  # (one host array, by route)
            assert row["memory_kind"] == "pinned_host" and row["host_gb"] > 0
        elif row["file"] == "compiled":  # (call 17's step, compiled by a process first)
            assert row["cache_after_compile"]["cache_misses"] > 0 and "losses" not in row
        elif row["file"] == "host_rss":  # (resident memory, stage by stage)
            assert row["stages"] and all(s["rss_gb"] >= 0 for s in row["stages"])
        elif row["file"] == "profile":  # (a step's time, from `jax.profiler`)
            assert len(row["step_s"]) == 4 and row["xplane_bytes"] > 0
        else:
            assert len(row["losses"]) == {"throughput": 2, "capacity": 20}[row["file"]]
            if call == "17":  # (its step read from the cache the first process wrote)
                assert row["compile_first_s"] > 0 and row["cache_after_compile"]["cache_hits"] > 0


def test_a_second_run_with_the_cache_compiles_nothing(tmp_path: pathlib.Path) -> None:
    """Call 14: the same row twice with `--cache`: the second run's compiles (the step's,
    beside the start-up, and the start-up's) are all hits of the first's entries; each
    run measures the fill rate and its start-up over it, the fill alone and in all
    (tracing and compiles: in sequence in the first run, beside the fill in the second)."""
    first, second = _next("14", tmp_path)
    assert (first["beside"], second["beside"]) == (False, True)
    for row in (first, second):
        assert "error" not in row and len(row["losses"]) == 3, row
        assert row["fill_gbps"] > 0 and row["startup_over_fill"] > 0
        assert row["startup_total_s"] > row["startup_s"] and row["compiles_in_steps"] == 0
        assert row["startup_total_over_fill"] > row["startup_over_fill"]
    assert first["cache"]["cache_misses"] > 0 and "cache_hits" not in first["cache"]
    assert "cache_misses" not in second["cache"], second["cache"]
    assert second["cache_after_compile"]["cache_hits"] > 0
    assert second["cache"]["cache_hits"] == first["cache"]["cache_misses"]
    assert second["losses"] == first["losses"]


@pytest.mark.parametrize("mode", [pytest.param(  # (libtpu compiles for a v5e)
    "+activations-once-int8state-backward", marks=tpu_plan_marks())])
def test_a_row_plans_its_step_for_a_v5e_without_one(mode: str) -> None:
    """`--plan`: the row's step compiled for a v5e (libtpu, no chip), the compiler's
    resident memory and XLA's memory analysis recorded: the host arguments are what the
    model and state store in host memory (the chip's tiles pad them a little)."""
    done = subprocess.run([sys.executable, "-W", "ignore", "bench/train.py", mode, "128", "2", "2",
                           "32", "2", "--plan"], cwd=ROOT, check=True, capture_output=True,
                          text=True, timeout=1500, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    row = json.loads(done.stdout.splitlines()[-1])
    assert "error" not in row and "losses" not in row, row
    stored, compiled = row["stored"]["pinned_host"], row["compiled"]
    assert stored <= compiled["host_argument_size_in_bytes"] <= stored * 11 // 10, row
    assert compiled["host_alias_size_in_bytes"] == compiled["host_argument_size_in_bytes"]
    assert row["resident_before_compile"] < row["resident_peak_compile"], row

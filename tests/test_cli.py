"""The command line: `python -m eqx_offload demo` and `python -m eqx_offload bench --quick`
run in subprocesses (as a user runs them), and the demo's bitwise check really compares."""

import json
import os
import subprocess
import sys

import numpy as np

from eqx_offload._demo import bitwise_equal


_SMALL_DEMO = ["--width", "32", "--depth", "2", "--features", "8", "--batch", "16",
               "--steps", "12", "--no-progress"]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "eqx_offload", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_demo_runs_and_is_bitwise_equal(tmp_path):
    out = tmp_path / "demo.json"
    proc = _run("demo", *_SMALL_DEMO, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loss trajectories (12 steps): bitwise equal" in proc.stdout
    result = json.loads(out.read_text())
    assert result["losses_bitwise_equal"] and result["final_params_bitwise_equal"]
    plain, off = result["plain"], result["offloaded"]
    assert plain["losses"] == off["losses"] and len(off["losses"]) == 12
    # Loss goes down, i.e. the demo trains.
    assert off["losses"][-1] < off["losses"][0]
    # Between steps: plain keeps its optimizer state on the device; offloaded keeps only
    # the 4-byte step counter there and the rest in pinned host memory.
    assert plain["opt_state_host_bytes"] == 0
    assert plain["opt_state_device_bytes"] == off["opt_state_host_bytes"] + 4
    assert off["opt_state_device_bytes"] == 4
    assert set(off["opt_state_by_kind"]) == {"device", "pinned_host"}
    assert off["params_device_bytes"] == plain["params_device_bytes"] > 0
    assert plain["compilations"] == 1 and off["compilations"] == 1


def test_demo_fails_when_trajectories_differ(tmp_path):
    # `--perturb` changes the offloaded run's learning rate by one part in a thousand:
    # the check must notice and the command must fail. (With another optimizer, to
    # cover `--optimizer` too.)
    out = tmp_path / "demo.json"
    proc = _run("demo", *_SMALL_DEMO, "--optimizer", "adafactor", "--perturb",
                "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "offloaded(optax.adafactor)" in proc.stdout
    assert "NOT bitwise equal" in proc.stdout
    result = json.loads(out.read_text())
    assert not result["losses_bitwise_equal"]
    assert result["plain"]["losses"][0] == result["offloaded"]["losses"][0]  # same start
    assert result["plain"]["losses"] != result["offloaded"]["losses"]


def test_bitwise_equal_compares_bits():
    a = np.array([0.0, 1.0, np.nan], np.float32)
    assert bitwise_equal(a, a.copy())
    # == says equal, the bits differ.
    assert not bitwise_equal(np.array([0.0], np.float32), np.array([-0.0], np.float32))
    # One ulp.
    b = a.copy()
    b[1] = np.nextafter(np.float32(1.0), np.float32(2.0))
    assert not bitwise_equal(a, b)
    # Same values, other dtype or structure.
    assert not bitwise_equal(a, a.astype(np.float64))
    assert not bitwise_equal({"x": a}, {"y": a})
    assert not bitwise_equal([a], [a, a])


def test_bench_quick(tmp_path):
    out = tmp_path / "bench"
    proc = _run("bench", "--quick", "--no-progress", "--platform", "cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(os.listdir(out))
    assert files == ["bench.json", "bench.md", "device_bytes.png", "movers.png",
                     "step_time_ratio.png"]
    for png in ("device_bytes.png", "movers.png", "step_time_ratio.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "bench.json").read_text())
    assert result["machine"]["backend"] == "cpu"
    assert result["machine"]["jax_version"]
    modes = {(p["optimizer"], p["mode"]) for p in result["points"]}
    assert modes == {(o, m) for o in ("adam", "adafactor")
                     for m in ("baseline", "manual", "eqx_offload", "streamed", "host_compute")}
    for p in result["points"]:
        assert p["losses_bitwise_equal_to_baseline"], p
        assert p["compilations"] == 1, p
        assert p["step_seconds"]["n"] == 3 and p["step_seconds"]["median"] > 0
        assert p["memory_analysis"] is not None and p["memory_analysis"]["argument_size_in_bytes"] > 0
        if p["mode"] == "baseline":
            assert p["opt_state_host_bytes"] == 0 and p["ratio_to_baseline"]["median"] == 1.0
        elif p["mode"] == "manual":
            assert p["opt_state_device_bytes"] == 0 and p["opt_state_host_bytes"] > 0
        else:
            assert p["opt_state_nonscalar_device_bytes"] == 0 and p["opt_state_host_bytes"] > 0
    assert [m["mib"] for m in result["movers"]] == [1, 16]
    assert all(m["to_host_gbps"] > 0 and m["numpy_copy_gbps"] > 0 for m in result["movers"])
    statuses = {t["target"]: t["status"] for t in result["targets"]}
    assert all(s in ("pass", "FAIL", "n/a") for s in statuses.values())
    assert any("compilation" in t and s == "pass" for t, s in statuses.items())
    assert "| target | result | numbers |" in (out / "bench.md").read_text()


def test_bench_reports_a_failing_mode_and_goes_on(monkeypatch):
    # A mode that fails to compile (e.g. an API a JAX version lacks) is reported with its
    # error; the other modes are still measured, and the run says it failed.
    from eqx_offload import _bench

    def broken(optimizer, model):
        runner = _bench._eqx_offload(optimizer, model)

        def step(*args):
            raise TypeError("this mode cannot compile here")

        runner.mode, runner.step = "manual", step
        return runner

    monkeypatch.setitem(_bench._MAKERS, "manual", broken)
    config = _bench.BenchConfig.quick().replace(
        repeats=2, modes=("baseline", "manual", "eqx_offload"))
    points = _bench.bench_point("adam", 2e4, config, lambda: None)
    assert [p["mode"] for p in points] == ["baseline", "manual", "eqx_offload"]
    failed = points[1]
    assert failed["error"] == "TypeError: this mode cannot compile here"
    for p in (points[0], points[2]):
        assert p["error"] is None and p["step_seconds"]["n"] == 2
        assert p["losses_bitwise_equal_to_baseline"] and p["ratio_to_manual"] is None
    targets = {t["target"]: t for t in _bench.evaluate_targets(points, [], config, "cpu")}
    assert targets["every mode ran"]["status"] == "FAIL"
    assert "manual (adam" in targets["every mode ran"]["detail"]
    assert targets["exactly one compilation per configuration (eqx_offload)"]["status"] == "pass"

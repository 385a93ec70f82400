"""The command line (`python -m eqx_offload`): its commands through `main`, in this process
(nothing in them can abort); the benchmarks' arithmetic, tables and workloads; GPU scripts."""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import equinox as eqx
import numpy as np
import optax
import pytest

import eqx_offload
import eqx_offload.__main__

from eqx_offload.cli import bench, COMMANDS, modes
from eqx_offload.cli.copies import floor, StateCopy
from eqx_offload.cli.measure import bitwise_equal
from eqx_offload.cli.models import (LMShape, lm_workload, make_lm, mlp_workload, num_params,
                                   SUCCESSORS, token_batches)
from eqx_offload.cli.tables import markdown
from helpers import gpu_plan_marks


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SMALL_DEMO = "--width 32 --depth 2 --features 8 --batch 16 --steps 12 --no-progress".split()
_PNGS = ["device_bytes.png", "floor_ratio.png", "loss_curves.png", "movers.png",
         "step_time_ratio.png"]
_HOST_BENCH_MODES = ("eqx_offload", "optax_jit", "hand_fused")


pytestmark = pytest.mark.once


def _run(capsys, *args: str, rc: int = 0) -> subprocess.CompletedProcess[str]:
    """`python -m eqx_offload ARGS`, in this process: its output, once it exited with `rc`."""
    capsys.readouterr()
    try:
        code = eqx_offload.__main__.main(list(args))
    except SystemExit as exit:  # argparse: --help, a usage error
        code = exit.code
    out = capsys.readouterr()
    assert code == rc, out.out + out.err
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


# --------------------------------------------------------------------------- package boundary
def test_import_does_not_load_the_cli():
    """Nor rich, tqdm, matplotlib or beartype (only install_runtime_checks loads it)."""
    code = textwrap.dedent("""
        import json, sys
        import eqx_offload
        loaded = lambda: sorted(m for m in sys.modules if m.startswith("eqx_offload.cli")
                                or m.split(".")[0] in ("rich", "tqdm", "matplotlib", "beartype"))
        before = loaded()
        # The cli's modules load only rich/tqdm/matplotlib when a command runs.
        import eqx_offload.cli.bench, eqx_offload.cli.demo, eqx_offload.cli.plots
        print(json.dumps([before, loaded()]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    before, after = json.loads(proc.stdout)
    assert before == []
    assert {"eqx_offload.cli", "eqx_offload.cli.bench", "eqx_offload.cli.demo"} <= set(after)
    assert not [m for m in after if not m.startswith("eqx_offload.cli")]


def test_cli_uses_only_the_public_api():
    """No module of the cli imports a private module or name of eqx_offload."""
    for path in sorted(pathlib.Path(REPO, "eqx_offload", "cli").glob("*.py")):
        # `eqx_offload._x` (a private module or name), `from .. import`, `from .._x`; but
        # `typings` reads `_stubs`, the shipped stubs' folders (packaging, not the API)
        private = r"eqx_offload\._(?!_|stubs import)|from \.\."
        assert not re.search(private, path.read_text()), path.name


@pytest.mark.parametrize("command,blocked", [("demo", "rich"), ("demo", "tqdm"),
                                             ("bench", "matplotlib")])
def test_a_missing_extra_fails_with_one_line(command, blocked, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, blocked, None)  # as if it were not installed
    proc = _run(capsys, command, "--platform", "cpu", rc=2)
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert blocked in lines[0] and 'pip install "eqx_offload[cli]"' in lines[0]


def test_help_and_typings_go_through_the_command_list(capsys):
    """`--help` lists the commands; `typings` through `eqx_offload.cli.main` prints what
    `python -m eqx_offload` prints."""
    proc = _run(capsys, "--help")
    for command in COMMANDS:
        assert command.name in proc.stdout
    assert [c.name for c in COMMANDS] == ["demo", "bench", "plan", "typings", "bench-host"]
    # One default platform for every command that has the option.
    assert {c.platform for c in COMMANDS} == {"cpu", None}
    assert [c.name for c in COMMANDS if c.platform is None] == ["typings"]
    assert "--quick" in _run(capsys, "bench-host", "--help").stdout
    from eqx_offload.cli import main

    assert main(["typings", "--mypy"]) == 0
    via_cli = capsys.readouterr().out
    assert _run(capsys, "typings", "--mypy").stdout == via_cli and via_cli.strip()


# --------------------------------------------------------------------------- demo
def test_demo_runs_and_is_bitwise_equal(tmp_path, capsys):
    out = tmp_path / "demo.json"
    proc = _run(capsys, "demo", *_SMALL_DEMO, "--json", str(out))
    # On the CPU: equality, placement, no saving (one RAM), no peak, why 4 B stay on the device.
    for line in ("loss trajectories (12 steps): bitwise equal", "placement: every opt-state array",
                 "device and host memory are the same RAM: nothing is saved here",
                 "peak device memory: not reported on the CPU",
                 "left on the device: 4 B, inner_state/0/count int32[]"):
        assert line in proc.stdout, line
    assert "saved between steps" not in proc.stdout
    result = json.loads(out.read_text())
    assert result["losses_bitwise_equal"] and result["final_params_bitwise_equal"]
    assert result["opt_state_placement_ok"] and result["backend"] == "cpu"
    assert result["offloaded"]["peak_device_bytes"] is None
    plain, off = result["plain"], result["offloaded"]
    assert plain["losses"] == off["losses"] and len(off["losses"]) == 12
    assert off["losses"][-1] < off["losses"][0]  # it trains
    # Between steps only the 4-byte step counter of the offloaded state is on the device.
    assert plain["opt_state_host_bytes"] == 0 and off["opt_state_device_bytes"] == 4
    assert plain["opt_state_device_bytes"] == off["opt_state_host_bytes"] + 4
    assert set(off["opt_state_by_kind"]) == {"device", "pinned_host"}
    assert off["params_device_bytes"] == plain["params_device_bytes"] > 0
    assert plain["compilations"] == 1 and off["compilations"] == 1


def test_demo_fails_when_trajectories_differ(tmp_path, capsys):
    """`--perturb` (the learning rate off by 1/1000) fails the check, with adafactor."""
    out = tmp_path / "demo.json"
    proc = _run(capsys, "demo", *_SMALL_DEMO, "--optimizer", "adafactor", "--perturb",
                "--json", str(out), rc=1)
    assert "offloaded(optax.adafactor)" in proc.stdout and "NOT bitwise equal" in proc.stdout
    result = json.loads(out.read_text())
    assert not result["losses_bitwise_equal"]
    assert result["plain"]["losses"][0] == result["offloaded"]["losses"][0]  # same start
    assert result["plain"]["losses"] != result["offloaded"]["losses"]


def test_bitwise_equal_compares_bits():
    a = np.array([0.0, 1.0, np.nan], np.float32)
    assert bitwise_equal(a, a.copy())
    b = a.copy()  # one ulp
    b[1] = np.nextafter(np.float32(1.0), np.float32(2.0))
    for x, y in [(np.array([0.0], np.float32), np.array([-0.0], np.float32)), (a, b),
                 (a, a.astype(np.float64)), ({"x": a}, {"y": a}), ([a], [a, a])]:
        assert not bitwise_equal(x, y), (x, y)


# --------------------------------------------------------------------------- models
@pytest.mark.parametrize("shape", [LMShape(vocab=64, width=32, layers=1, heads=2, seq=16),
                                   LMShape(vocab=100, width=48, layers=3, heads=4, seq=10),
                                   LMShape(vocab=8, width=8, layers=1, heads=2, seq=4)])
def test_lm_shape_counts_the_parameters(shape):
    abstract = eqx.filter_eval_shape(make_lm, shape, 0)
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract)
               if isinstance(x, jax.ShapeDtypeStruct)) == shape.params
    assert num_params(make_lm(shape, 0)) == shape.params


def test_lm_data_is_a_learnable_language():
    shape = LMShape(vocab=32, width=32, layers=1, heads=2, seq=24, batch=8)
    tokens = np.asarray(token_batches(shape, 3, 0)[0])
    assert tokens.shape == (8, 24) and tokens.dtype == np.int32
    assert tokens.min() >= 0 and tokens.max() < shape.vocab
    # At most SUCCESSORS successors per token: a learnable language.
    successors: dict[int, set[int]] = {}
    for row in tokens:
        for a, b in zip(row[:-1], row[1:]):
            successors.setdefault(int(a), set()).add(int(b))
    assert max(map(len, successors.values())) <= SUCCESSORS < len(successors)
    logits = eqx.filter_eval_shape(lambda: jax.vmap(make_lm(shape, 0))(jnp.asarray(tokens)))
    assert logits.shape == (8, 24, shape.vocab)


# --------------------------------------------------------------------------- the benchmark
def test_floor_arithmetic():
    to_device, to_host = (StateCopy(f"copy_to_{to}", [], [], 1000) for to in ("device", "host"))
    to_device.seconds, to_host.seconds = [1.0, 4.0, 2.0], [2.0, 1.0, 2.0]
    f = floor([to_device, to_host], [3.0, 3.0, 1.0])
    assert f["one_way_seconds"]["all"] == [2.0, 4.0, 2.0]
    assert f["full_duplex_seconds"]["all"] == [3.0, 4.0, 2.0]  # max(baseline, one way)
    assert f["no_overlap_seconds"]["all"] == [5.0, 7.0, 3.0]   # baseline + one way
    assert f["serial_seconds"]["all"] == [6.0, 8.0, 5.0]       # baseline + both
    assert f["baseline_over_one_way"] == 3.0 / 2.0
    assert f["to_device_gbps"] == 1000 / 2.0 / 1e9 and f["state_bytes"] == 1000


def test_bench_quick(tmp_path, capsys):
    """Every default mode and the loss curves on the MLP (the transformer: below)."""
    out = tmp_path / "bench"
    proc = _run(capsys, "bench", "--quick", "--no-progress", "--platform", "cpu", "--out", str(out),
                "--workloads", "mlp", "--optimizers", "adam", "--loss-curves", "streamed")
    assert sorted(os.listdir(out)) == sorted(["bench.json", "bench.md", *_PNGS])
    for png in _PNGS:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "bench.json").read_text())
    assert result["machine"]["backend"] == "cpu" and result["machine"]["jax_version"]
    assert set(result["modes"]) == set(modes.MODES)
    points = result["points"]
    assert [p["mode"] for p in points] == list(modes.DEFAULT_MODES)
    for p in points:
        _check_point(p)
        if p["mode"] == "manual":
            assert p["opt_state_device_bytes"] == 0 and p["opt_state_host_bytes"] > 0
        elif p["mode"] != "baseline":
            assert p["opt_state_nonscalar_device_bytes"] == 0 and p["opt_state_host_bytes"] > 0
    assert [m["mib"] for m in result["movers"]] == [1]
    assert all(m["to_host_gbps"] > 0 and m["numpy_copy_gbps"] > 0 for m in result["movers"])
    [curve] = result["loss_curves"]
    assert (curve["workload"], curve["mode"], curve["steps"]) == ("mlp", "streamed", 8)
    assert curve["bitwise_equal"] and curve["losses"] == curve["baseline"]
    assert len(set(curve["losses"])) == 8  # one loss per step, from 8 batches
    statuses = {t["target"]: t["status"] for t in result["targets"]}
    assert all(s in ("pass", "FAIL", "n/a") for s in statuses.values())
    assert statuses["exactly one compilation per configuration (eqx_offload)"] == "pass"
    md = (out / "bench.md").read_text()
    assert "| target | result | numbers |" in md and "estimate: full duplex ms" in md
    assert "Loss curves against the baseline" in md
    assert max(map(len, proc.stdout.splitlines())) <= 100, proc.stdout
    assert "× est." in proc.stdout and "× floor" not in proc.stdout


def _check_point(p):
    """What holds for every measured point of the benchmark."""
    assert p["error"] is None and p["optimizer"] == "adam", p
    assert p["losses_bitwise_equal_to_baseline"] and p["compilations"] == 1, p
    assert p["step_seconds"]["n"] == 3 and p["step_seconds"]["median"] > 0
    assert p["memory_analysis"]["argument_size_in_bytes"] > 0
    # ratio to the floor: median of step / max(baseline, one-way copy)
    ratios = np.divide(p["step_seconds"]["all"], p["floor"]["full_duplex_seconds"]["all"])
    assert p["ratio_to_floor"]["median"] == pytest.approx(np.median(ratios))
    if p["mode"] == "baseline":
        assert p["opt_state_host_bytes"] == 0 and p["ratio_to_baseline"]["median"] == 1.0
        assert p["ratio_to_floor"]["median"] <= 1.0
    if p["mode"] == "eqx_offload":
        assert p["floor"]["state_bytes"] == p["opt_state_host_bytes"] > 0


def test_bench_transformer_point():
    config = bench.BenchConfig.quick().replace(modes=("baseline", "eqx_offload"))
    ticks = []
    points = bench.bench_point(lm_workload(config.lm), "adam", config, lambda: ticks.append(1))
    assert len(ticks) == 4 * (config.warmup + config.repeats)  # 2 modes x 2 copies
    assert [(p["workload"], p["mode"]) for p in points] == [("transformer", "baseline"),
                                                            ("transformer", "eqx_offload")]
    for p in points:
        _check_point(p)
        assert p["params"] == config.lm.params and p["shape"]["width"] == config.lm.width
    assert abs(points[0]["final_loss"] - np.log(config.lm.vocab)) < 1.0  # untrained: log(vocab)
    assert points[0]["floor"]["baseline_over_one_way"] > 0


def _broken_build(mode, optimizer, model, loss):
    runner = modes.MODES["eqx_offload"].build(mode, optimizer, model, loss)

    def step(*args):
        raise TypeError("this mode cannot compile here")

    runner.step = step
    return runner


def test_a_new_mode_is_one_entry_and_a_failing_mode_is_reported(monkeypatch):
    """A mode that fails to compile is reported with its error, the others still run and
    the run fails; a mode added to the table is measured like the others."""
    monkeypatch.setitem(modes.MODES, "manual", modes.Mode("fails", _broken_build))
    monkeypatch.setitem(modes.MODES, "streamed_64k", modes.offload_mode(
        "offloaded(optimizer, group_bytes=65536)", group_bytes=65536))
    config = bench.BenchConfig.quick().replace(
        repeats=2, modes=("baseline", "manual", "eqx_offload", "whole_state", "streamed_64k"))
    points = bench.bench_point(mlp_workload(2e4, 8), "adam", config, lambda: None)
    assert [p["mode"] for p in points] == list(config.modes)
    assert points[1]["error"] == "TypeError: this mode cannot compile here"
    for p in (points[0], *points[2:]):
        assert p["error"] is None and p["step_seconds"]["n"] == 2 and p["compilations"] == 1
        assert p["losses_bitwise_equal_to_baseline"] and p["ratio_to_manual"] is None
    assert points[4]["opt_state_host_bytes"] == points[2]["opt_state_host_bytes"] > 0
    targets = {t["target"]: t for t in bench.evaluate_targets(points, [], [], 30e6, "cpu")}
    assert targets["every mode ran"]["status"] == "FAIL"
    assert "manual (mlp adam" in targets["every mode ran"]["detail"]
    assert targets["exactly one compilation per configuration (eqx_offload)"]["status"] == "pass"
    assert bench.failures({"points": points, "loss_curves": []}) == [
        "manual (mlp adam, 20,800 params): TypeError: this mode cannot compile here"]


def test_mode_table():
    assert list(modes.MODES)[0] == "baseline"
    assert "host_bf16" in modes.MODES and "host_bf16" not in modes.DEFAULT_MODES
    assert "whole_state" in modes.MODES and "whole_state" not in modes.DEFAULT_MODES
    assert modes.MODES["whole_state"].options == {"group_bytes": None}
    assert not modes.MODES["host_bf16"].bitwise
    assert modes.MODES["host_bf16"].options == {"host_dtype": jnp.bfloat16}
    assert modes.MODES["streamed"].options == {"group_bytes": 0}
    assert modes.MODES["baseline"].options is None
    for mode in modes.MODES.values():
        assert mode.description and "\n" not in mode.description


@pytest.mark.parametrize("name", [n for n, m in modes.MODES.items() if m.options is not None])
def test_offload_modes_keep_the_state_in_host_memory(name):
    """The `offloaded` options of every mode keep the state in host memory."""
    params = {"w": jnp.ones((16, 8)), "b": jnp.ones(8)}
    opt = eqx_offload.offloaded(optax.adam(1e-3), **modes.MODES[name].options)
    _, state = jax.jit(opt.update)(params, opt.init(params), params)
    kinds = {leaf.path: leaf.memory_kind for leaf in eqx_offload.memory_report(state).leaves}
    assert {k for p, k in kinds.items() if "count" not in p} == {"pinned_host"}, kinds


def test_bench_config_overrides_and_a_time_limit_that_skips_points():
    config = bench.BenchConfig.quick().replace(
        time_limit=0.0, mover_mib=(), loss_curves=("streamed",),
        workloads=("mlp", "transformer"), optimizers=("adam", "adafactor"))
    result = bench.run_bench(config, progress=False)
    assert result["points"] == [] and result["loss_curves"] == []
    # 1 MLP size x (adam, adafactor), the LM x adam, then the loss curves of both
    assert len(result["skipped"]) == 2 + 1 + 2
    assert result["skipped"][2].startswith("transformer adam")
    assert result["skipped"][-1] == "loss curves: transformer"
    assert "Skipped (time limit)" in markdown(result)
    config = bench.BenchConfig.quick().replace(
        workloads=("transformer", "mlp"), optimizers=("adam", "adafactor"), lm_optimizers=("adam",))
    assert [w.name for w in config.workload_list()] == ["transformer", "mlp"]
    assert config.optimizers_for(lm_workload(config.lm)) == ("adam",)
    assert config.optimizers_for(mlp_workload(2e4, 8)) == ("adam", "adafactor")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--sizes", "1e5", "--lm-width", "64",
                              "--lm-optimizers", "adam", "--movers", "--time-limit", "5",
                              "--modes", "baseline", "host_bf16"])
    config = bench.config_from(args)
    assert config.sizes == (1e5,) and config.lm.width == 64 and config.lm.vocab == 64
    assert config.lm_optimizers == ("adam",) and config.mover_mib == ()
    assert config.time_limit == 5.0 and config.modes == ("baseline", "host_bf16")
    assert config.is_quick and config.optimizers == ("adam",) and config.workloads == ("mlp",)


# --------------------------------------------------------------------------- the GPU scripts
@pytest.mark.slow
def test_gpu_run_script_on_the_cpu(tmp_path):
    """The prepared GPU command on the CPU, tiny: it runs the checkout, at most 8 files in $OUT."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    # baseline and the default mode: the others are test_bench_quick's
    args = ("--platform cpu --sizes 2e4 --lm-vocab 64 --lm-width 32 --lm-layers 1 --lm-heads 2 "
            "--lm-seq 16 --lm-batch 4 --repeats 2 --warmup 1 --movers 1 --loss-steps 3 "
            "--time-limit 900 --modes baseline eqx_offload --loss-curves eqx_offload").split()
    proc = subprocess.run(["bash", os.path.join(REPO, "bench", "gpu_run.sh"), *args],
                          capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == sorted(["bench.json", "bench.md", "gpu_run.log", *_PNGS])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["config"]["workloads"] == ["transformer", "mlp"]
    assert [(p["workload"], p["optimizer"], p["mode"]) for p in result["points"]] == [
        (w, "adam", m) for w in ("transformer", "mlp") for m in ("baseline", "eqx_offload")]
    assert "eqx_offload" in (tmp_path / "gpu_run.log").read_text()


# --------------------------------------------------------------------------- bench-host
def _check_rates(r):
    assert r["gbps"] > 0 and r["gb_per_cpu_second"] > 0 and r["cpu_per_wall"] > 0
    assert 0 < r["gbps_range"][0] <= r["gbps"] <= r["gbps_range"][1]
    assert r["wall"]["n"] == 3 and all(t > 0 for t in r["wall"]["all"])
    assert r["wall"]["min"] <= r["wall"]["median"] <= r["wall"]["max"]


def test_bench_host_quick_writes_positive_numbers(tmp_path, capsys, monkeypatch):
    """The JSON's structure, positive numbers, the condition's arithmetic, the torch hint."""
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    path = tmp_path / "host.json"
    proc = _run(capsys, "bench-host", "--quick", "--json", str(path))
    assert "pip install torch" in proc.stdout
    result = json.loads(path.read_text())
    machine = result["machine"]
    assert machine["bytes_per_parameter"] == 28 and machine["backend"] == "cpu"
    assert machine["cpu_count"] >= 1 and machine["torch_version"] is None
    assert [row["parameters"] for row in result["sizes"]] == [100_000, 1_000_000]
    for row in result["sizes"]:
        assert "skipped" not in row and row["bytes_touched"] == 28 * row["parameters"]
        assert sorted(row["results"]) == sorted(_HOST_BENCH_MODES)  # no torch column
        for name in _HOST_BENCH_MODES:
            _check_rates(row["results"][name])
            hlo = row["hlo"][name]
            assert hlo["passes_per_leaf"] >= 1 and hlo["bytes_accessed"] > 0
        _check_rates(row["copy"])
        assert row["copy"]["bytes"] == 8 * row["parameters"]
    summary = result["summary"]
    host = result["sizes"][-1]["results"]["eqx_offload"]["gbps"]
    assert summary["H_gbps"] == host and summary["copy_over_H"] > 0
    # XLA's program: at least one loop over each leaf, at least the 28 B a parameter.
    assert summary["xla"]["passes_per_leaf"] >= 1 and summary["xla"]["bytes_per_parameter"] >= 28
    assert [c["link"] for c in summary["condition"]] == [
        "PCIe 4.0 x16", "PCIe 5.0 x16", "H200 link, measured"]
    for c in summary["condition"]:
        assert c["H_needed_fp32"] == pytest.approx(3.5 * c["L_gbps"])
        assert c["wins_fp32"] == (host > 3.5 * c["L_gbps"])
        # The page's inequality: 28 / H + 8 / L < 16 / L.
        assert c["wins_fp32"] == (c["host_over_device_time_fp32"] < 1)
    assert result["hand_fused_bitwise_equal_to_optax"] is True
    assert max(map(len, proc.stdout.splitlines())) <= 100, proc.stdout


def test_bench_host_skips_a_size_that_cannot_fit(tmp_path, capsys):
    path = tmp_path / "host.json"
    proc = _run(capsys, "bench-host", "--sizes", "1e14", "--repeats", "1", "--no-torch",
                "--json", str(path))
    (row,) = json.loads(path.read_text())["sizes"]
    assert row["skipped"].startswith("needs about") and row["results"] == {}
    assert "skipped: needs about" in proc.stdout and "nothing measured" in proc.stdout


_PLAN = gpu_plan_marks()  # no GPU compiler here: a skip with the install command


@pytest.mark.parametrize("level,shown", [pytest.param(None, False, marks=_PLAN),
                                         pytest.param("0", True, marks=_PLAN)])
def test_plan_hides_xlas_rematerialization_warning(level, shown):
    """`plan` raises JAX's default C++ log level (1) to 2: XLA's "Can't reduce memory use
    below ..." does not bury the plan. Level 0, as docs/gpu-plan.md says, shows it."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env |= {"JAX_PLATFORMS": "cpu"} | ({} if level is None else {"TF_CPP_MIN_LOG_LEVEL": level})
    proc = subprocess.run(
        [sys.executable, "-m", "eqx_offload", "plan", "--width", "64", "--depth", "1",
         "--batch", "64", "--modes", "baseline", "--target", "h100", "--device-memory", "0.03"],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| baseline |" in proc.stdout and "| NO |" in proc.stdout
    assert ("by rematerialization" in proc.stderr) == shown

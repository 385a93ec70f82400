"""`python -m eqx_offload bench-host --quick`, called in this process through the same
`main` as the command line: the JSON's structure, positive numbers, the condition's
arithmetic, the torch hint, and a size that cannot fit being skipped. No timing
thresholds. It does not depend on the JAX version (the `once` marker)."""

import json
import sys

import pytest

import eqx_offload.__main__

from eqx_offload.cli import COMMANDS


pytestmark = pytest.mark.once

_JAX = ("eqx_offload", "optax_jit", "hand_fused")


def _main(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = eqx_offload.__main__.main(list(args))
    return rc, capsys.readouterr().out


def _check_rates(r: dict) -> None:
    assert r["gbps"] > 0 and r["gb_per_cpu_second"] > 0 and r["cpu_per_wall"] > 0
    assert 0 < r["gbps_range"][0] <= r["gbps"] <= r["gbps_range"][1]
    assert r["wall"]["n"] == 3 and all(t > 0 for t in r["wall"]["all"])
    assert r["wall"]["min"] <= r["wall"]["median"] <= r["wall"]["max"]


def test_quick_writes_positive_numbers(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    path = tmp_path / "host.json"
    rc, out = _main(capsys, "bench-host", "--quick", "--json", str(path))
    assert rc == 0, out
    assert "pip install torch" in out
    result = json.loads(path.read_text())
    machine = result["machine"]
    assert machine["bytes_per_parameter"] == 28 and machine["backend"] == "cpu"
    assert machine["cpu_count"] >= 1 and machine["torch_version"] is None
    assert [row["parameters"] for row in result["sizes"]] == [100_000, 1_000_000]
    for row in result["sizes"]:
        assert "skipped" not in row
        assert row["bytes_touched"] == 28 * row["parameters"]
        assert sorted(row["results"]) == sorted(_JAX)  # no torch column
        for name in _JAX:
            _check_rates(row["results"][name])
            hlo = row["hlo"][name]
            assert hlo["passes_per_leaf"] >= 1 and hlo["bytes_accessed"] > 0
        _check_rates(row["copy"])
        assert row["copy"]["bytes"] == 8 * row["parameters"]
    summary = result["summary"]
    host = result["sizes"][-1]["results"]["eqx_offload"]["gbps"]
    assert summary["H_gbps"] == host and summary["copy_over_H"] > 0
    # XLA's program: at least one loop over each leaf, at least the 28 B a parameter.
    assert summary["xla"]["passes_per_leaf"] >= 1
    assert summary["xla"]["bytes_per_parameter"] >= 28
    assert [c["link"] for c in summary["condition"]] == [
        "PCIe 4.0 x16", "PCIe 5.0 x16", "H200 link, measured"]
    for c in summary["condition"]:
        assert c["H_needed_fp32"] == pytest.approx(3.5 * c["L_gbps"])
        assert c["wins_fp32"] == (host > 3.5 * c["L_gbps"])
        # The page's inequality: 28 / H + 8 / L < 16 / L.
        assert c["wins_fp32"] == (c["host_over_device_time_fp32"] < 1)
    assert result["hand_fused_bitwise_equal_to_optax"] is True
    for line in out.splitlines():
        assert len(line) <= 100, line


def test_a_size_that_cannot_fit_is_skipped(tmp_path, capsys):
    path = tmp_path / "host.json"
    rc, out = _main(capsys, "bench-host", "--sizes", "1e14", "--repeats", "1", "--no-torch",
                    "--json", str(path))
    assert rc == 0, out
    (row,) = json.loads(path.read_text())["sizes"]
    assert row["skipped"].startswith("needs about") and row["results"] == {}
    assert "skipped: needs about" in out and "nothing measured" in out


def test_the_command_is_listed(capsys):
    assert "bench-host" in [c.name for c in COMMANDS]
    rc = None
    try:
        _main(capsys, "bench-host", "--help")
    except SystemExit as exit:
        rc = exit.code
    assert rc == 0
    assert "--quick" in capsys.readouterr().out

"""Optax's own test files, with every optimizer they build wrapped in `offloaded`, in a
child pytest with `optax_suite/plugin.py`: every test passes but the expected failures of
`optax_suite/adaptations.py` (`docs/optax-tests.md`)."""

import json
import os
import subprocess
import sys
from typing import Any

import optax
import pytest
from isolated import shared_cache


SUITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "optax_suite")
OPTAX = os.path.dirname(os.path.abspath(optax.__file__))
sys.path.insert(0, SUITE)
from adaptations import ADAPT, XFAIL  # noqa: E402
from selection import glob, GROUPS  # noqa: E402


sys.path.remove(SUITE)


def run_child(tmp_path: Any, rootdir: str, paths: list[str]) -> tuple[int, str, dict[str, Any]]:
    """The exit code, output and report of the plugin over `paths` in a fresh pytest."""
    report = tmp_path / "report.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([SUITE, os.environ.get("PYTHONPATH", "")]),
        "EQX_OFFLOAD_SUITE_REPORT": str(report),
        "JAX_PLATFORMS": "cpu",
        # The run's compilation cache (optax's eager `lax.cond`s compile one program each
        # step); a hit is still logged as a compilation, as optax's checks expect.
        **shared_cache(),
    }
    env.pop("EQX_OFFLOAD_SUITE_ADAPT_ALL", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    process = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", os.path.join(SUITE, "pytest.ini"),
         "--rootdir", rootdir, "-p", "plugin", "-q", "-n", "0", "-rfE", "--tb=short",
         *paths],
        cwd=rootdir, env=env, capture_output=True, text=True, timeout=3000,
    )
    data = json.loads(report.read_text()) if report.exists() else {}
    return process.returncode, process.stdout + process.stderr, data


@pytest.mark.slow
def test_optax_suite(tmp_path: Any) -> None:
    """Every group in one child, each group checked on its own from the report's counts."""
    paths = [path for group in sorted(GROUPS) for path in GROUPS[group]]
    rc, output, report = run_child(tmp_path, OPTAX, paths)
    failures = {k: v for k, v in report.get("outcomes", {}).items() if v.startswith("failed")}
    assert rc == 0 and not failures, (
        f"optax's tests with offloaded optimizers failed (exit {rc}):\n"
        + "\n".join(f"{k}\n    {v}" for k, v in failures.items())
        + f"\n--- output ---\n{output[-6000:]}"
    )
    assert report["patched_functions"] >= 150  # optax's factories were really patched
    for group in sorted(GROUPS):
        _check_group(group, report)


def _check_group(group: str, report: dict[str, Any]) -> None:
    """What must hold of the tests of `group`'s files in the child's report."""
    ours = tuple(path + "::" for path in GROUPS[group])
    outcomes = {k: v for k, v in report["outcomes"].items() if k.startswith(ours)}
    counts = {k: c for k, c in report["counts"].items() if k.startswith(ours)}
    assert len(counts) >= 40, f"{group}: only {len(counts)} tests ran"
    # Most tests built an (offloaded) optimizer; eager calls checked the placement.
    built = [k for k, c in counts.items() if c["wrapped"]]
    assert len(built) >= 0.6 * len(counts), (group, len(built), len(counts))
    assert sum(c["checked"] for c in counts.values()) >= 50, group
    # Every adaptation and expected failure of this group names a test that ran.
    ran = set(outcomes) | set(counts)
    for pattern in (*ADAPT, *XFAIL):
        if any(pattern.startswith(path) for path in GROUPS[group]):
            assert any(glob(pattern, key) for key in ran), f"{group}: stale entry: {pattern}"
    xfailed = [k for k, v in outcomes.items() if v == "xfailed"]
    print(f"{group}: {len(counts)} tests, {len(xfailed)} expected failures")


def test_plugin_selfcheck(tmp_path: Any) -> None:
    """The plugin over its own check file: offloaded once, outermost, state on the host;
    a listed failure is an xfail, a listed pass or another failure a failure."""
    rc, output, report = run_child(tmp_path, SUITE, ["selfcheck.py"])
    outcomes = report["outcomes"]
    assert outcomes.pop("selfcheck.py::test_listed_failure_is_xfail") == "xfailed", output
    assert outcomes.pop("selfcheck.py::test_listed_pass_is_failure").startswith("failed")
    other = outcomes.pop("selfcheck.py::test_listed_other_failure_is_failure")
    assert other.startswith("failed") and "not the expected message" in other
    assert outcomes == {
        f"selfcheck.py::test_{name}": "passed"
        for name in ["alias_is_offloaded", "combinator_offloads_once_outermost",
                     "inject_hyperparams_offloaded_once", "multi_steps_offloaded_once",
                     "numbers_match_unwrapped"]
    }, output
    assert rc == 1  # the two deliberate failures

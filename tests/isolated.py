"""Run a test-module function in a fresh Python process, so that a pattern that can abort
the process (XLA aliasing a donated buffer across memory kinds) fails a test, not the suite.
The child imports the test file with `runpy`, calls one module-level function with JSON
arguments, and prints its JSON result after a marker line."""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any


_MARK = "@@isolated-result@@"
_TESTS = os.path.dirname(os.path.abspath(__file__))
_CHILD = """
import json, runpy, sys
sys.path.insert(0, {tests!r})
module = runpy.run_path({file!r})
result = module[{name!r}](*json.loads({args!r}))
print({mark!r} + json.dumps(result), flush=True)
"""


def run_isolated(func: Callable[..., Any], *args: Any, timeout: float = 600,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs `func(*args)` in a fresh Python (`-W error`, 8 CPU devices, CPU only, this
    environment updated with `env`); `func` is a module-level function of a file in
    `tests/`, its arguments and result JSON-serialisable."""
    file = sys.modules[func.__module__].__file__
    assert file is not None
    code = _CHILD.format(tests=_TESTS, file=os.path.abspath(file), name=func.__name__,
                         args=json.dumps(args), mark=_MARK)
    child_env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8",
                 "PYTHONHASHSEED": "0", **shared_cache(), **(env or {})}
    return subprocess.run([sys.executable, "-W", "error", "-W", _CACHE_RACE, "-c", code],
                          capture_output=True, text=True, timeout=timeout, env=child_env,
                          cwd=_TESTS)


# The run's compilation cache (conftest.py's CACHE_VARIABLE): a child compiles what its
# parent or another process of the run already compiled once. An entry read while another
# process writes it is a miss (as pyproject.toml lets it pass in the tests): it compiles.
_CACHE_RACE = "ignore:Error reading persistent compilation cache entry:UserWarning"


def shared_cache() -> dict[str, str]:
    """The environment that points a child process at the run's compilation cache, every
    program cached (empty outside a test run)."""
    folder = os.environ.get("EQX_OFFLOAD_TEST_JAX_CACHE")
    return {} if folder is None else {
        "JAX_COMPILATION_CACHE_DIR": folder, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def result_of(process: subprocess.CompletedProcess) -> Any:
    """The JSON result of a finished `run_isolated` child; fails (with its output) if it
    did not exit cleanly."""
    lines = [line for line in process.stdout.splitlines() if line.startswith(_MARK)]
    assert process.returncode == 0 and lines, (
        f"child exited with {process.returncode}\n--- stdout ---\n{process.stdout[-4000:]}"
        f"\n--- stderr ---\n{process.stderr[-8000:]}")
    return json.loads(lines[-1][len(_MARK):])


def call_isolated(func: Callable[..., Any], *args: Any, env: dict[str, str] | None = None) -> Any:
    """`run_isolated` and `result_of` in one."""
    return result_of(run_isolated(func, *args, env=env))

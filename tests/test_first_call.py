"""What the package runs in a call of the docs' `update_in_backward` step, measured by
`scripts/trace_calls.py` (`sys.settrace` over the package's files): the first call
(trace, compile, run), the cached call and the eager call, each within its bounds."""

import json
import os
import pathlib
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]
# The most each call may run: lines of the package's files (distinct), files, and moves
# between files. The cached and eager calls do not grow; the first call's goals are 450
# lines, 14 files and 600 moves.
BOUNDS = {
    # (first and eager +12 lines: the CPU fences of a streamed piece's rows of state and
    # update, bitwise on JAX 0.12 with AVX-512; first +4: the backward loop's read of
    # each layer's state before the write into its leaf; first and eager +16 lines and
    # +65 moves: the top two layers' loop of the backward update, traced apart, so that
    # no iteration writes a layer it does not update; then -7 lines, first and eager,
    # and -217 moves first, -145 eager: a move's destination asked in `move` itself,
    # the stacked check skipped for the layers the backward update checked, the loss
    # traced once, the state's type checked once; then +16 lines and +23 moves, first
    # and eager: the top layer's VJP in a loop of its own, so that its state is read
    # once, and the backward pass marked for its TPU compiler options; then -1 file
    # first: the program being traced kept by `_jit/stage`, which sets it; then -7
    # lines and -24 moves first, -11 lines, -1 file and -24 moves eager: the engine's
    # moves to host with no `where` to resolve; then -51 lines, -2 files and -44 moves
    # first: `offloaded`'s `init` finds the layout of the state it makes, so the step's
    # updates (the rest's, a layer's) look it up; then -18 lines first, -14 eager:
    # `put`'s moved leaves chosen by comprehensions, the backward loop's consts'
    # cotangents summed in its layer VJP, the step's rest gradients as the VJP gives
    # them, output paths' common suffix counted without a loop; the cached bound at the
    # 76 lines it runs)
    "first": {"lines": 699, "files": 16, "moves": 448},
    "cached": {"lines": 76, "files": 5, "moves": 10},
    "eager": {"lines": 490, "files": 14, "moves": 402},
}


def _script() -> dict[str, object]:
    import runpy

    return runpy.run_path(str(ROOT / "scripts" / "trace_calls.py"))


def test_each_call_runs_within_its_bounds() -> None:
    # (the oldest environment's JAX, 0.10.2: BOUNDS were counted there; another JAX
    # takes other paths through `_core/compat`)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "trace_calls.py")],
                          capture_output=True, text=True, env=env, timeout=600, check=True)
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    for call, bounds in BOUNDS.items():
        for what, most in bounds.items():
            assert 0 < measured[call][what] <= most, (call, what, measured)


@pytest.mark.once
def test_the_measure_counts_lines_files_and_moves(tmp_path: pathlib.Path) -> None:
    """Two files calling each other: each line once, two files, a move where the next
    line run is in the other file."""
    package = tmp_path / "package"
    package.mkdir()
    (package / "a.py").write_text("def a(b):\n    x = b()\n    return x + b()\n")
    (package / "b.py").write_text("def b():\n    return 1\n")
    sys.path.insert(0, str(package))
    try:
        import a  # type: ignore[import-not-found]  # (made above)
        import b  # type: ignore[import-not-found]  # (made above)

        measure = _script()["measure"]
        counts = measure(lambda: a.a(b.b), str(package))  # type: ignore[operator]
    finally:
        sys.path.remove(str(package))
        sys.modules.pop("a", None)
        sys.modules.pop("b", None)
    # a:2 -> b:2 -> a:3 -> b:2 (a return to a line already begun runs no new line)
    assert counts == {"lines": 3, "files": 2, "moves": 3}

"""A user's mistake shows the user's line and then the message, not the library's frames
between them (`compat.hide_frames` and `compat.boundary`, as Equinox hides its own):
read from the traceback that a fresh Python prints."""

import os
import pathlib
import subprocess
import sys

import pytest


REPO = pathlib.Path(__file__).resolve().parents[2]
SETUP = """import jax
import jax.numpy as jnp
import optax
import eqx_offload

params = {"w": jnp.ones((3, 3))}
opt = eqx_offload.offloaded(optax.adam(1e-3))
state = opt.init(params)
"""
USER_LINE = SETUP.count("\n") + 1


def _printed(tmp_path: pathlib.Path, mistake: str) -> tuple[list[str], list[str]]:
    """The frames (`File "...", line N, in f`) and the lines after the last frame's
    source line that Python prints for `mistake`, run after `SETUP` in a script."""
    script = tmp_path / "user.py"
    script.write_text(SETUP + mistake + "\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_TRACEBACK_FILTERING"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=600, check=False)
    assert run.returncode == 1, run.stderr
    lines = run.stderr.splitlines()
    start = lines.index("Traceback (most recent call last):")
    frames = [line.strip() for line in lines[start:] if line.startswith('  File "')]
    last = max(i for i, line in enumerate(lines) if line.startswith('  File "'))
    after = [line for line in lines[last + 1:] if not line.startswith("    ")]
    return frames, after


def _library(frames: list[str]) -> list[str]:
    package = str(REPO / "eqx_offload") + os.sep
    return [f for f in frames if f.startswith(f'File "{package}')]


@pytest.mark.parametrize("mistake, message", [
    ('opt.update({"w": jnp.ones((4, 4))}, state, params)',
     "TypeError: add got incompatible shapes for broadcasting: (4, 4), (3, 3)."),
    ('jax.jit(opt.update)({"w": jnp.ones((4, 4))}, state, params)',
     "TypeError: add got incompatible shapes for broadcasting: (4, 4), (3, 3)."),
], ids=["eager", "jax.jit"])
def test_a_shape_mismatch_shows_the_users_line_and_no_library_frame(
        tmp_path: pathlib.Path, mistake: str, message: str) -> None:
    """The gradients do not match the parameters: the error is raised in optax's
    arithmetic, below `offloaded`'s update; none of the package's frames is printed."""
    frames, after = _printed(tmp_path, mistake)
    assert frames[0] == f'File "{tmp_path / "user.py"}", line {USER_LINE}, in <module>'
    assert _library(frames) == []
    assert after[0] == message


def test_the_packages_own_error_follows_the_users_line(tmp_path: pathlib.Path) -> None:
    """An error the package raises (here: the inner state passed where the
    `OffloadedState` goes) is printed right below the user's line."""
    frames, after = _printed(tmp_path, "opt.update(params, state.inner_state, params)")
    assert frames == [f'File "{tmp_path / "user.py"}", line {USER_LINE}, in <module>']
    assert after[0].startswith("eqx_offload._core.errors.StateError: offloaded(...).update("
                               "state=...) expects the OffloadedState"), after

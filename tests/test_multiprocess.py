"""Offload on JAX's distributed runtime: two processes of `tests/mp_worker.py` on 127.0.0.1,
two CPU devices each."""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mp_worker


TIME_LIMIT = 180.0  # seconds for both processes together


def run_processes(tmp_path: Path, commands: list[list[str]]) -> list[str]:
    """Runs the `{port}`-formatted commands on a free port, CPU only, without this process's
    JAX/XLA settings; kills what outlives `TIME_LIMIT`; asserts all exit 0; returns their output."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    logs, procs = [tmp_path / f"worker{i}.log" for i in range(len(commands))], []
    for cmd, path in zip(commands, logs):
        with open(path, "wb") as log:
            procs.append(subprocess.Popen([c.format(port=port) for c in cmd], stdout=log,
                                          stderr=subprocess.STDOUT, cwd=tmp_path,
                                          env=env | {"JAX_PLATFORMS": "cpu"}))
    deadline = time.monotonic() + TIME_LIMIT
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            proc.kill()  # once exited, a no-op
            proc.wait()
    text = [path.read_text(errors="replace")[-4000:] for path in logs]
    report = "\n".join(f"--- worker {i} (exit {p.returncode}; time limit {TIME_LIMIT}s):\n{t}"
                       for i, (p, t) in enumerate(zip(procs, text)))
    assert all(p.returncode == 0 for p in procs), report
    return text


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path: Path) -> None:
    out = tmp_path / "two_processes.npz"
    worker = [sys.executable, mp_worker.__file__]
    run_processes(tmp_path, [[*worker, "0", "{port}", str(out)], [*worker, "1", "{port}"]])
    two = dict(np.load(out))
    assert int(two.pop("__num_processes__")) == 2
    assert int(two.pop("__num_devices__")) == 4
    one = mp_worker.train()  # the same training in this process, on 4 of its 8 devices
    assert int(one.pop("__num_processes__")) == 1
    one.pop("__num_devices__")
    # Between steps every moment on the host with its parameter's spec, the counter on
    # the device, in both runs.
    kinds = [str(k) for k in two.pop("__kinds__")]
    assert kinds == [str(k) for k in one.pop("__kinds__")]
    assert ".inner_state[0].count device P()" in kinds
    assert ".inner_state[0].mu['w1'] pinned_host P(None, 'model')" in kinds
    assert ".inner_state[0].nu['w2'] pinned_host P('model', None)" in kinds
    assert sum("pinned_host" in k for k in kinds) == 8
    assert sorted(two) == sorted(one)
    for name in one:
        assert two[name].dtype == one[name].dtype and two[name].shape == one[name].shape, name
        # Bitwise: gloo's all-reduce of two 2-device halves adds in the same order here.
        assert two[name].tobytes() == one[name].tobytes(), (name, two[name], one[name])
    for k, v in mp_worker.initial_values()[0].items():  # it trained: every parameter moved
        assert not np.array_equal(one[f"[0]['{k}']"], v), k


@pytest.mark.slow
def test_documented_example(tmp_path: Path) -> None:
    """docs/multi-process.md's one ```py block, run as it says: `python train_mp.py ID PORT`."""
    page = Path(__file__).resolve().parent.parent / "docs" / "multi-process.md"
    blocks = re.findall(r"^```py\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    assert len(blocks) == 1, "docs/multi-process.md should hold exactly one ```py block"
    script = tmp_path / "train_mp.py"
    script.write_text(blocks[0])
    out0, _ = run_processes(
        tmp_path, [[sys.executable, str(script), str(i), "{port}"] for i in range(2)])
    losses = [float(m) for m in re.findall(r"step \d: loss ([0-9.]+)", out0)]
    assert len(losses) == 5 and losses[-1] < losses[0], out0

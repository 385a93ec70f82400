"""Offload on JAX's distributed runtime: two processes on 127.0.0.1, two CPU devices each,
running `tests/mp_worker.py` without this process's JAX/XLA settings, on a free port,
killed if they outlive the time limit."""

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


WORKER = Path(__file__).with_name("mp_worker.py")
TIME_LIMIT = 180.0  # seconds for both processes together


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_processes(tmp_path: Path, commands: list[list[str]]) -> list[str]:
    """Runs the `{port}`-formatted commands on a free port, CPU only, without any JAX/XLA
    setting; kills what outlives `TIME_LIMIT`; asserts all exit 0; returns their output."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    procs, logs = [], []
    try:
        for i, cmd in enumerate(commands):
            log = open(tmp_path / f"worker{i}.log", "w+b")
            logs.append(log)
            procs.append(subprocess.Popen([c.format(port=port) for c in cmd], env=env,
                                          stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
        deadline = time.monotonic() + TIME_LIMIT
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = False
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                timed_out = True
        text = []
        for log in logs:
            log.seek(0)
            text.append(log.read().decode(errors="replace")[-4000:])
            log.close()
    report = "\n".join(f"--- worker {i} (exit {p.returncode}):\n{t}" for i, (p, t) in enumerate(zip(procs, text)))
    assert not timed_out, f"killed after {TIME_LIMIT}s\n{report}"
    assert all(p.returncode == 0 for p in procs), report
    return text


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path: Path) -> None:
    out = tmp_path / "two_processes.npz"
    run_processes(tmp_path, [
        [sys.executable, str(WORKER), "--process-id", str(i), "--num-processes", "2",
         "--devices", "2", "--port", "{port}", *(["--out", str(out)] if i == 0 else [])]
        for i in range(2)])
    two = dict(np.load(out))
    assert int(two.pop("__num_processes__")) == 2
    assert int(two.pop("__num_devices__")) == 4

    # The same training in this process, on 4 of its 8 devices.
    one = mp_worker.train()
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
    # it trained: every parameter moved
    initial, _ = mp_worker.initial_values()
    for k, v in initial.items():
        assert not np.array_equal(one[f"[0]['{k}']"], v), k


DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "multi-process.md"


@pytest.mark.slow
def test_documented_example(tmp_path: Path) -> None:
    """docs/multi-process.md's one ```py block, run as the page says: `python train_mp.py ID PORT`."""
    blocks = re.findall(r"^```py\n(.*?)^```", DOCS_PAGE.read_text(), flags=re.S | re.M)
    assert len(blocks) == 1, "docs/multi-process.md should hold exactly one ```py block"
    script = tmp_path / "train_mp.py"
    script.write_text(blocks[0])
    out0, _ = run_processes(tmp_path,
                            [[sys.executable, str(script), str(i), "{port}"] for i in range(2)])
    losses = [float(m) for m in re.findall(r"step \d: loss ([0-9.]+)", out0)]
    assert len(losses) == 5 and losses[-1] < losses[0], out0

"""The host's bytes, counted on the CPU: after `filter_make` and a few donated steps of a
stacked decoder (`bench/llama.py`) in each capacity mode, the process's resident memory
above its baseline is at most 1.05x the bytes of every array the mode stores (the model
and its state), and nothing else is alive. On the CPU backend every memory kind is the
process's own memory, so a host array kept twice (a model and its master copy both made,
an output that does not alias its donated input) shows here.

Each mode runs in a fresh process (`MALLOC_MMAP_THRESHOLD_` fixed, so that a freed
array's pages go back to the system and the baseline is the process without arrays).
The baseline is the resident memory after one whole run (every program compiled) and
the deletion of its arrays; the second run (the same programs) is measured against it,
in steady state and at the start-up's peak (`VmHWM`, reset through
`/proc/self/clear_refs`)."""

import gc
import pathlib
import sys
from typing import Any

import pytest

from isolated import call_isolated


BENCH = str(pathlib.Path(__file__).resolve().parents[2] / "bench")
MODES = ["state", "+master", "+params", "+activations"]


def _resident(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def host_bytes_worker(mode: str, steps: int) -> dict[str, Any]:
    """In a child: the resident memory above the baseline, the bytes the mode stores and
    the bytes of every live array, after `filter_make` and `steps` steps."""
    import jax
    from eqx_offload._models import make

    sys.path.insert(0, BENCH)
    from harness import bytes_by_kind, step_of, tokens_of, train, trainer
    from llama import LlamaShape

    shape = LlamaShape("rss", width=512, layers=8, heads=4, kv_heads=4, ffn=1536,
                       vocab=2048, seq=16, batch=1)
    start, grad_step = trainer(shape, mode)
    # The same programs both times (`filter_make` is `make.run(make.route(...))`).
    route, step = make.route(start, (jax.random.key(0),), {}), step_of(grad_step)

    def run(peaks: list[int]) -> tuple[Any, Any]:
        model, state = jax.block_until_ready(make.run(route))
        peaks.append(_resident("VmHWM"))
        model, state, losses, _ = train(step, model, state, tokens_of(shape), steps)
        assert losses[-1] < losses[0]
        return jax.block_until_ready((model, state))

    made = run([])  # compiles every program
    del made
    gc.collect()
    baseline = _resident()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) from here
    peaks: list[int] = []
    model, state = run(peaks)
    gc.collect()
    stored = sum(bytes_by_kind((model, state)).values())
    live = sum(x.nbytes for x in jax.live_arrays())
    leaves = route.leaves
    layer = sum(leaves[i].size * leaves[i].dtype.itemsize // p.layers
                for p in route.programs if p.kind == "layers" for i in p.indices)
    return {"above_baseline": _resident() - baseline, "stored": stored, "live": live,
            "layer": layer,
            "startup_peak_above_baseline": peaks[0] - baseline,
            "kinds": bytes_by_kind((model, state))}


@pytest.mark.parametrize("mode", MODES)
def test_resident_memory_is_what_the_mode_stores(mode: str) -> None:
    got = call_isolated(host_bytes_worker, mode, 3,
                        env={"MALLOC_MMAP_THRESHOLD_": "65536", "JAX_NUM_CPU_DEVICES": "1"})
    assert got["stored"] > 250e6  # the arrays dominate the process
    assert got["live"] <= got["stored"] + 1e6  # nothing else alive but the tokens
    assert "pinned_host" in got["kinds"]
    assert got["above_baseline"] <= 1.05 * got["stored"], got
    # The start-up's peak too: no array was made twice (an fp32 model beside its master
    # copy). Beyond what is stored, it holds what the route holds on the device (the
    # CPU's device memory is the process's too): one layer of the stacked leaves.
    assert got["startup_peak_above_baseline"] <= 1.05 * got["stored"] + got["layer"], got

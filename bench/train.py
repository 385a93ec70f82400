"""One row of a benchmark table: the project's Llama in one mode (`harness.MODES`), made
where each array lives (`eqx_offload.filter_make`) and trained on one batch of random
tokens. One process per row (the device's peak cannot be reset within one):

    python bench/train.py MODE WIDTH LAYERS [STEPS SEQ BATCH] [--micro K] [--file NAME]
        [--cache DIR] [--beside | --compile-first]
    JAX_PLATFORMS=cpu python bench/train.py MODE WIDTH LAYERS [STEPS SEQ BATCH] --plan

STEPS (default 20) optimizer steps at sequence SEQ (1024) and batch BATCH (4); with
`--micro K`, each sums the gradients of K micro-batches in a scan and updates once.
The step is traced from abstract arguments, then compiled before the model and state are
made (the compiler's memory apart); with `--beside`, while `filter_make` makes them; with
`--compile-first`, by a process run first (`--compile-only`: compiles into the `--cache`,
exits), which this one reads. Prints a line a step and one JSON record (`harness.record`,
appended to $OUT/NAME.jsonl when OUT is set; NAME defaults to `capacity`): seconds
(compile, `filter_make`'s `startup_s`, `startup_total_s` from tracing to the model made
and the step compiled, each step), tokens a second, losses, bytes stored by memory kind,
XLA's memory analysis, resident memory (around the compile, start-up and first step),
`fill_gbps` and each start-up over the host bytes at that rate (`*_over_fill`).
`--cache DIR`: JAX's persistent compilation cache, every program cached (`cache`: its
events; `compile_first_s`: the first process's seconds, in `startup_total_s`). `--plan`
compiles for a v5e deviceless and stops. Steps end by ROW_SECONDS."""

import argparse
import collections
import concurrent.futures
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_offload

sys.path.insert(0, os.path.dirname(__file__))
import harness  # (bench/)


STARTED = time.perf_counter()
ANALYSIS = tuple(f"{host}{what}_size_in_bytes" for host in ("", "host_")
                 for what in ("argument", "output", "alias", "temp"))
# What libtpu needs to compile for a v5e without one (as tests/helpers.py's `TPU_ENV`).
TPU_ENV = {"TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_WORKER_HOSTNAMES": "localhost",
           "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def lower_ahead(start: Any, grad_step: Any, shape: Any, micro: int,
                on: Any) -> tuple[Any, Any, dict[str, Any]]:
    """The donated step lowered for the device of `on` (a one-device mesh: an abstract
    `pinned_host` array of a `SingleDeviceSharding` traces as device memory) from
    `filter_eval_shape` of `start`, allocating nothing; its abstract `(model, state,
    tokens)`; and what it took (`lower_s`, resident memory)."""
    (device,) = on.device_set
    key, tokens = jax.eval_shape(lambda: (jax.random.key(0), harness.tokens_of(shape, micro)))
    model, state = eqx_offload.checkpoint.filter_eval_shape(
        start, jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=on))
    abstract = (model, state, jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=on))
    took: dict[str, Any] = {"resident_before_compile": harness.resident()}
    began = time.perf_counter()
    lowered = harness.step_of(grad_step, micro).lower_for((device.platform,), abstract, {})
    took.update(lower_s=time.perf_counter() - began, resident_after_lower=harness.resident())
    return lowered, abstract, took


def compile_lowered(lowered: Any, took: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """`lowered` compiled, and `took` with its seconds, resident memory (after, at the peak,
    after `trim`) and XLA's memory analysis."""
    began = time.perf_counter()
    compiled = lowered.compile()
    took = {**took, "compile_s": time.perf_counter() - began, "resident_after_compile":
            harness.resident(), "resident_peak_compile": resource.getrusage(0).ru_maxrss << 10}
    trim()
    analysis = compiled.memory_analysis()
    return compiled, {**took, "resident_after_trim": harness.resident(),
                      "compiled": {f: getattr(analysis, f, None) for f in ANALYSIS}}


def fill_gbps(nbytes: int, on: Any, timed: list[tuple[str, float, float]]) -> float:
    """GB/s at which `filter_make` makes new `pinned_host` memory (run first; freed after):
    8 stacked float32 layers, `nbytes` (at most 1 GiB), less the time its tracing and
    compiles cover (`timed`: `(event, end, seconds)`; nested events once)."""
    rows = max(min(nbytes, 1 << 30) // 32, 1)
    made = lambda keys: eqx_offload.to_host(eqx_offload.stack_layers(  # noqa: E731
        lambda _: jnp.zeros((rows,), jnp.float32), keys))
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), on)
    before, began = len(timed), time.perf_counter()
    jax.block_until_ready(eqx_offload.filter_make(made, keys)).delete()
    took, covered, reach = time.perf_counter() - began, 0.0, began
    for first, last in sorted((end - seconds, end) for _, end, seconds in timed[before:]):
        covered, reach = covered + max(0.0, last - max(first, reach)), max(reach, last)
    return rows * 32 / 1e9 / (took - covered)


def trim() -> None:
    """Free what Python and glibc's heap hold unused (`malloc_trim(0)`: to the system)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def v5e() -> Any:
    """The first chip of a v5e topology, compile-only (libtpu, no TPU needed)."""
    from jax.experimental import topologies
    os.environ.update(TPU_ENV)
    return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]


def main(name: str, width: int, layers: int, steps: int = 20, seq: int = 1024, batch: int = 4,
         micro: int = 1, plan: bool = False, cache: Optional[str] = None, beside: bool = False,
         first: Optional[list[str]] = None, compile_only: bool = False) -> dict[str, Any]:
    began = time.perf_counter()  # (the compiling process first: before this one's runtime)
    done = subprocess.run(first, check=True, stdout=subprocess.PIPE, text=True) if first else None
    first_s, first_row = (time.perf_counter() - began, json.loads(  # (its record, last)
        done.stdout.splitlines()[-1])) if done else (0.0, {})
    assert "error" not in first_row, f"the compiling process: {first_row['error']}"
    shape = harness.llama_shape(width, layers, seq, batch)
    events: collections.Counter[str] = collections.Counter()  # (the persistent cache's)
    timed: list[tuple[str, float, float]] = []  # (JAX's tracing, lowering and compiles)
    jax.monitoring.register_event_duration_secs_listener(lambda event, seconds, **_: timed.extend(
        [(event, time.perf_counter(), seconds)] * event.startswith("/jax/core/compile/")))
    if cache:  # (every program cached, however short its compile)
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        jax.monitoring.register_event_listener(lambda event, **_: events.update(
            [event.split("/")[-1]] if event.startswith("/jax/compilation_cache/") else []))
    harness.machine()  # (before the host fills: see `harness.machine`)
    row: dict[str, Any] = {"mode": name, "shape": shape.name, "params": shape.params,
                           "seq": seq, "batch": batch, "micro_batches": micro,
                           "tokens_per_step": micro * batch * seq, "beside": beside,
                           "backend": "tpu v5e (compile only)" if plan else jax.default_backend()}
    start, grad_step = harness.trainer(shape, name)
    on = NamedSharding(Mesh([v5e() if plan else jax.devices()[0]], ("_",)), P())
    if not plan:  # (first: new memory, before the compiler's is freed; the compiling
        # process's measure where there is one: the runtime keeps the probe's memory)
        row["fill_gbps"] = first_row.get("fill_gbps") or fill_gbps(4 * shape.params, on, timed)
    began = time.perf_counter()
    lowered, abstract, took = lower_ahead(start, grad_step, shape, micro, on)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # (tracing holds Python's lock)
        compiling = pool.submit(compile_lowered, lowered, took)
        if not beside:
            step, took = compiling.result()
            ahead_s = time.perf_counter() - began
            row.update(took, cache_after_compile=dict(events))
            print(json.dumps({**row, "phase": "compiled"}), flush=True)
            if plan or compile_only:  # (and what the process holds without the executable)
                if compile_only:  # (the start-up's programs too: `filter_make` compiles none)
                    eqx_offload.filter_make(start, jax.device_put(jax.random.key(0), on),
                                            compile_only=True)
                del step, compiling, lowered
                trim()
                return harness.record(**row, stored=harness.bytes_by_kind(abstract[:2]),
                                      resident_without_executable=harness.resident())
        filling = time.perf_counter()
        # (every array with the sharding `filter_eval_shape` gave it: the compiled step's)
        model, state = eqx_offload.filter_make(start, jax.device_put(jax.random.key(0), on))
        model, state = jax.block_until_ready((model, state))
        row.update(startup_s=time.perf_counter() - filling, cache_after_startup=dict(events),
                   stored=harness.bytes_by_kind((model, state)),
                   resident_after_startup=harness.resident())
        step, took = compiling.result()
    if beside:  # (the compile's fields, and the cache's events, after both)
        row.update(took, cache_after_compile=dict(events))
    row.update(compile_first_s=first_s, startup_total_s=first_s + (
        time.perf_counter() - began if beside else ahead_s + row["startup_s"]))
    host_s = row["stored"].get("pinned_host", 0) / 1e9 / row["fill_gbps"]
    for what in ("startup", "startup_total"):
        row[f"{what}_over_fill"] = row[f"{what}_s"] / host_s if host_s else None
    tokens = jax.device_put(harness.tokens_of(shape, micro), on)

    def progress(losses: list[float], times: list[float]) -> None:
        if len(times) == 1:
            row["resident_after_first_step"] = harness.resident()
        print(json.dumps({**row, "losses": losses, "step_s": times, "phase": f"step {len(times)}",
                          "resident": harness.resident()}), flush=True)

    progress([], [])
    left = float(os.environ.get("ROW_SECONDS", "inf")) - (time.perf_counter() - STARTED)
    before = len(timed)  # (compiles during the steps: none, the step is compiled)
    model, state, losses, times = harness.train(step, model, state, tokens, steps, left, progress)
    return harness.record(**row, losses=losses, step_s=times, falls=losses[-1] < losses[0],
                          compiles_in_steps=sum(e.endswith("backend_compile_duration")
                                                for e, *_ in timed[before:]), cache=events,
                          **harness.timing(times, row["tokens_per_step"]))


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line's arguments: `mode` (read by `harness.mode_of`), `numbers`
    (WIDTH LAYERS, up to STEPS SEQ BATCH), `micro`, `file`, `cache` and the flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode")
    parser.add_argument("numbers", type=int, nargs="+", metavar="WIDTH LAYERS [STEPS SEQ BATCH]")
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--file", default="capacity")
    parser.add_argument("--cache", metavar="DIR")
    for flag in ("--plan", "--beside", "--compile-first", "--compile-only"):
        parser.add_argument(flag, action="store_true")
    args = parser.parse_args(argv)
    if not 2 <= len(args.numbers) <= 5:
        parser.error("give WIDTH LAYERS, then up to STEPS SEQ BATCH")
    if args.plan and args.beside:
        parser.error("--beside makes the model while the step compiles: not with --plan")
    if (args.compile_first or args.compile_only) and not args.cache:
        parser.error("--compile-first and --compile-only compile into a cache: add --cache DIR")
    try:
        harness.mode_of(args.mode)  # (an unknown mode fails here, before JAX starts)
    except ValueError as error:
        parser.error(str(error))
    return args


if __name__ == "__main__":
    args = parse(sys.argv[1:])
    width, layers, *rest = args.numbers
    first = [sys.executable, *(a for a in sys.argv if a != "--compile-first"),
             "--compile-only", "--file", "compiled"]
    harness.run_row(args.file, {"mode": args.mode, "width": width, "layers": layers},
                    lambda: main(args.mode, width, layers, *rest, micro=args.micro,
                                 plan=args.plan, cache=args.cache, beside=args.beside,
                                 first=first if args.compile_first else None,
                                 compile_only=args.compile_only))

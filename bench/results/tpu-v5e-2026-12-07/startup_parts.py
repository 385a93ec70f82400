"""A second start-up from the persistent cache, its parts timed, in one of several orders
(one process a row; run `bench/train.py MODE WIDTH LAYERS 1 --cache DIR --compile-only`
or `compile` first, `seq` before `loadonly` and `compile` before `load`):

    python startup_parts.py ORDER DIR [MODE WIDTH LAYERS]

ORDER: `compile` (a cold process: the step compiled and saved with
`Compiled.serialize` to DIR/step.bin.eqx, `filter_make(..., compile_only=True)`), `load`
(`filter_jit(step).load` of those bytes in a thread while the main thread fills, then
three steps), `seq` (trace, compile, fill, one after the other; then the compiled step
serialized to DIR/step.bin), `beside` (`bench/train.py --beside`: trace, then compile in a
thread while the main thread fills), `fillfirst` (fill in a thread, trace and compile in
the main thread), `loadonly` (DIR/step.bin loaded in a thread while the main thread
fills: no tracing). Prints one JSON record: the seconds of each part and in all, the fill
bound (host bytes at the probe's rate of new pinned memory), the dispatch of each
`filter_make` program, and each stall of a thread that asks for Python's lock every 5 ms
(`gil_stalls`: start, seconds; stalls over 0.1 s)."""

import concurrent.futures
import dataclasses
import json
import os
import pickle
import sys
import threading
import time

import jax
from jax.experimental import serialize_executable
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench"))
import harness
import train
import eqx_offload
from eqx_offload._models import make

T0 = time.perf_counter()
marks: list[tuple[str, float, float]] = []  # (what, start, seconds)
stalls: list[tuple[float, float]] = []


def now() -> float:
    return round(time.perf_counter() - T0, 3)


def timed(what: str, fun, *args):
    began = now()
    out = fun(*args)
    marks.append((what, began, round(now() - began, 3)))
    return out


def sampler(stop: threading.Event) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        time.sleep(0.005)
        t = time.perf_counter()
        if t - last > 0.1:
            stalls.append((round(last - T0, 2), round(t - last, 2)))
        last = t


_run = make.run


def run(made):  # (filter_make's programs, each call timed)
    marks.append(("route done", now(), 0.0))
    wrap = lambda p: dataclasses.replace(p, fun=lambda *a: timed(p.what[:24], p.fun, *a))  # noqa: E731
    return _run(dataclasses.replace(made, programs=tuple(map(wrap, made.programs))))


make.run = run


PARTS = ("lower", "compile", "fill", "load", "serialize", "route done")  # (timed apart)


def programs(marks: list[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    """Each `filter_make` program's calls: the first's start, the last's end, how many,
    and the longest (a dispatch that waited)."""
    out: dict[str, dict[str, float]] = {}
    for what, began, took in marks:
        if what not in PARTS:
            o = out.setdefault(what, {"first": began, "calls": 0, "longest": 0.0})
            o.update(calls=o["calls"] + 1, end=round(began + took, 3),
                     longest=max(o["longest"], took))
    return out


def main(order: str, cache: str, mode: str, width: int, layers: int) -> dict:
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    shape = harness.llama_shape(width, layers, 1024, 4)
    start, grad_step = harness.trainer(shape, mode)
    on = NamedSharding(Mesh([jax.devices()[0]], ("_",)), P())
    row = {"order": order, "mode": mode, "params": shape.params,
           "fill_gbps": train.fill_gbps(4 * shape.params, on, [])}
    key = jax.device_put(jax.random.key(0), on)
    fill = lambda: jax.block_until_ready(eqx_offload.filter_make(start, key))  # noqa: E731
    lower = lambda: train.lower_ahead(start, grad_step, shape, 1, on)[0]  # noqa: E731
    compile_ = lambda lowered: lowered.compile()  # noqa: E731
    path = os.path.join(cache, "step.bin")
    stop = threading.Event()
    threading.Thread(target=sampler, args=(stop,), daemon=True).start()
    marks.clear()  # (the probe's)
    began = now()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        if order == "seq":
            compiled = timed("compile", compile_, timed("lower", lower))
            made = timed("fill", fill)
            total = now() - began
            inner = compiled._executable.compiled
            blob = timed("serialize", serialize_executable.serialize, inner)
            with open(path, "wb") as f:
                pickle.dump(blob, f)
            row["serialized_bytes"] = len(blob[0])
        elif order == "beside":
            lowered = timed("lower", lower)
            compiling = pool.submit(timed, "compile", compile_, lowered)
            made = timed("fill", fill)
            compiling.result()
        elif order == "fillfirst":
            filling = pool.submit(timed, "fill", fill)
            timed("compile", compile_, timed("lower", lower))
            made = filling.result()
        elif order == "compile":  # (a cold process: the step saved, every program cached)
            compiled = timed("compile", compile_, timed("lower", lower))
            data = timed("serialize", compiled.serialize)
            with open(path + ".eqx", "wb") as f:
                f.write(data)
            timed("fill", lambda: eqx_offload.filter_make(start, key, compile_only=True))
            row["serialized_bytes"], made = len(data), None
        elif order == "load":  # (`filter_jit(step).load` of the bytes `compile` saved)
            with open(path + ".eqx", "rb") as f:
                data = f.read()
            step = harness.step_of(grad_step)
            loading = pool.submit(timed, "load", step.load, data)
            made = timed("fill", fill)
            compiled = loading.result()
        elif order == "loadonly":
            with open(path, "rb") as f:
                blob = pickle.load(f)
            loading = pool.submit(timed, "load", serialize_executable.deserialize_and_load,
                                  *blob)
            made = timed("fill", fill)
            loading.result()
        else:
            raise SystemExit(f"ORDER: compile, load, seq, beside, fillfirst or loadonly; got {order}")
        if order != "seq":
            total = now() - began
    stop.set()
    if made is None:
        return harness.record(**row, parts={w: (b, s) for w, b, s in marks if w in PARTS})
    host = harness.bytes_by_kind(made).get("pinned_host", 0)
    bound = host / 1e9 / row["fill_gbps"]
    if order in ("load", "beside"):  # (three steps: the losses and the step's seconds)
        compiled = compiled if order == "load" else compiling.result()
        tokens = jax.device_put(harness.tokens_of(shape), on)
        row.update(zip(("losses", "step_s"), harness.train(compiled, *made, tokens, 3)[2:]))
    return harness.record(**row, total_s=round(total, 3), bound_s=round(bound, 3),
                          over_bound=round(total / bound, 3), host_bytes=host,
                          parts={w: (b, s) for w, b, s in marks if w in PARTS},
                          programs=programs(marks), gil_stalls=sorted(stalls, key=lambda s: -s[1])[:20],
                          gil_stalled_s=round(sum(s for _, s in stalls), 2))


if __name__ == "__main__":
    order, cache, *rest = sys.argv[1:]
    mode, width, layers = (rest[0], int(rest[1]), int(rest[2])) if rest else (
        "+params-once-int8state-backward", 2048, 66)
    print(json.dumps(main(order, cache, mode, width, layers)), flush=True)

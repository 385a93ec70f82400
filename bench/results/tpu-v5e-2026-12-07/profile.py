"""Where a step's time goes on the chip: the project's Llama in one mode
(`bench/harness.py`), compiled ahead (`bench/train.py`), 3 steps to warm, 4 timed, then 2
under `jax.profiler`. From the trace (`jax.profiler.ProfileData`), per device plane: each
line's events; on the ops lines, the time by op kind (the name before its first '.'), the
time ops ran (the union of their intervals, loops and calls left out), and the waits
(`copy-done`, `copy-start`, ...). One JSON line; the step's ops, one per line, gzipped
beside it as OUT/profile-MODE.jsonl.gz.

    python bench/results/tpu-v5e-2026-12-07/profile.py MODE WIDTH LAYERS [SEQ BATCH] [--micro K]
"""

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_offload

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, ROOT)
import harness  # noqa: E402  (bench/)
import train  # noqa: E402  (bench/)

CONTAINERS = ("while", "conditional", "call", "async")


def union(spans: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("numbers", type=int, nargs="+")
    p.add_argument("--micro", type=int, default=1)
    a = p.parse_args()
    width, layers, *rest = a.numbers
    seq, batch = (rest + [1024, 4][len(rest):])[:2]
    shape = harness.llama_shape(width, layers, seq, batch)
    start, grad_step = harness.trainer(shape, a.mode)
    on = NamedSharding(Mesh([jax.devices()[0]], ("_",)), P())  # (train.py's, since 2026-12-07b)
    lowered, abstract, took = train.lower_ahead(start, grad_step, shape, a.micro, on)
    step, took = train.compile_lowered(lowered, took)
    model, state = jax.tree.map(lambda x, s: jax.device_put(x, s.sharding, may_alias=True),
                                eqx_offload.filter_make(start, jax.device_put(jax.random.key(0), on)),
                                abstract[:2])
    tokens = jax.device_put(harness.tokens_of(shape, a.micro), on)
    model, state, losses, warm = harness.train(step, model, state, tokens, 3)
    model, state, more, timed = harness.train(step, model, state, tokens, 4)
    trace = tempfile.mkdtemp()
    jax.profiler.start_trace(trace)
    model, state, _, traced = harness.train(step, model, state, tokens, 2)
    jax.block_until_ready((model, state))
    jax.profiler.stop_trace()
    path = glob.glob(os.path.join(trace, "**", "*.xplane.pb"), recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(path)
    row = {"mode": a.mode, "params": shape.params, "micro": a.micro, "compile_s": took["compile_s"],
           "warm_s": warm, "step_s": timed, "traced_s": traced, "losses": losses + more,
           "xplane_bytes": os.path.getsize(path), "planes": {}}
    out = os.environ.get("OUT", ".")
    dump = gzip.open(os.path.join(out, f"profile-{a.mode}-{layers}-{a.micro}.jsonl.gz"), "wt")
    for plane in data.planes:
        if "TPU" not in plane.name and "GPU" not in plane.name:
            continue
        lines = {}
        for line in plane.lines:
            events = list(line.events)
            info = {"events": len(events)}
            if events:
                t0 = min(e.start_ns for e in events)
                info["span_ms"] = (max(e.start_ns + e.duration_ns for e in events) - t0) / 1e6
                info["first"] = [e.name for e in events[:5]]
            if "Op" in line.name and events:
                kinds = collections.Counter()
                counts = collections.Counter()
                spans = []
                for e in events:
                    kind = e.name.split(".")[0]
                    kinds[kind] += e.duration_ns
                    counts[kind] += 1
                    if not kind.startswith(CONTAINERS):
                        spans.append((e.start_ns, e.start_ns + e.duration_ns))
                info["by_kind_ms"] = {k: [round(v / 1e6, 3), counts[k]]
                                      for k, v in kinds.most_common(40)}
                info["busy_ms"] = union(spans) / 1e6
                top = collections.Counter()
                for e in events:
                    top[e.name] += e.duration_ns
                info["top_ms"] = {k: round(v / 1e6, 3) for k, v in top.most_common(40)}
                info["stats"] = {e.name: {k: str(v)[:200] for k, v in e.stats} for e in events[:3]}
                for e in events:
                    long = dict(e.stats).get("long_name", "")
                    dump.write(json.dumps([line.name, e.name, (e.start_ns - t0) / 1e3,
                                           e.duration_ns / 1e3, str(long)[:160]]) + "\n")
            lines[line.name] = info
        row["planes"][plane.name] = lines
    dump.close()
    print(json.dumps(row))
    with open(os.path.join(out, "profile.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

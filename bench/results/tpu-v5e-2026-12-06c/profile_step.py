"""Where one step's time goes on the chip: a mode of bench/tpu/capacity_chip.py, a few
steps timed, then two traced with jax.profiler; the trace is read back with
jax.profiler.ProfileData and each device line's events summed by name (top 40).
Prints one JSON line; writes the raw trace to $OUT/<mode>.xplane.pb when it is < 15 MiB.

  python profile_step.py MODE WIDTH LAYERS [SEQ] [BATCH]
"""
import collections
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench", "tpu"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import capacity_chip  # noqa: E402
import eqx_offload  # noqa: E402

name, width, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
seq, batch = (int(a) for a in (sys.argv[4:6] or ["1024", "4"]))
shape = capacity_chip.shape_of(width, layers, seq, batch)
record = {"mode": name, "params": shape.params}
model, state, grad_step = capacity_chip.start(shape, name, record)


@eqx_offload.filter_jit(donate=("model", "state"))
def step(model, state, tokens):
    return grad_step(model, state, tokens, None)


tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, shape.vocab)
times = []
for _ in range(5):
    t = time.perf_counter()
    model, state, loss = step(model, state, tokens)
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - t)
record["step_ms"] = [round(t * 1e3, 1) for t in times]
record["median_ms"] = round(statistics.median(times[1:]) * 1e3, 1)
d = tempfile.mkdtemp()
with jax.profiler.trace(d):
    for _ in range(2):
        model, state, loss = step(model, state, tokens)
        jax.block_until_ready(loss)
paths = glob.glob(d + "/**/*.xplane.pb", recursive=True)
pd = jax.profiler.ProfileData.from_file(paths[0])
lines = {}
for plane in pd.planes:
    if "TPU" not in plane.name and "device" not in plane.name.lower():
        continue
    for line in plane.lines:
        total = collections.Counter()
        count = collections.Counter()
        span = [None, None]
        for ev in line.events:
            total[ev.name] += ev.duration_ns
            count[ev.name] += 1
            span[0] = ev.start_ns if span[0] is None else min(span[0], ev.start_ns)
            span[1] = ev.end_ns if span[1] is None else max(span[1], ev.end_ns)
        if not total:
            continue
        lines[f"{plane.name}|{line.name}"] = {
            "span_ms": round((span[1] - span[0]) / 1e6, 2),
            "sum_ms": round(sum(total.values()) / 1e6, 2),
            "top": [[n, round(v / 2e6, 3), count[n] // 2] for n, v in total.most_common(40)],
        }
record["lines"] = lines
out = os.environ.get("OUT")
if out and os.path.getsize(paths[0]) < 15 * 2**20:
    shutil.copy(paths[0], os.path.join(out, name.replace("+", "p") + ".xplane.pb"))
print(json.dumps(record), flush=True)

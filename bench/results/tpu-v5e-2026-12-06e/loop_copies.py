"""The host<->device copies of each computation of XLA:TPU's scheduled HLO (a while
loop's body included, which `bench/results/tpu-v5e-2026-12-06c/overlap.py` does not
read): the async `copy`, `slice`, `dynamic-slice` and `dynamic-update-slice` starts that
touch host memory (`S(5)`), each way: how many, their bytes, how many have a compute
instruction between start and end (`under_compute`) or a copy the other way in flight
(`both_ways`), the most in flight; and the schedule replayed with each direction a lane
of 14 GB/s, compute free (`link_ms`), against the larger direction's bytes
(`full_duplex_ms`) and both directions' (`serial_ms`). Computations with fewer than 4
such copies are left out.

    python loop_copies.py STEP.hlo   # from plan_backward.py
"""
import json
import re
import sys

LINE = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*(?P<type>.*?)\s"
                  r"(?P<op>[a-z][a-z0-9\-]*)\((?P<args>[^)]*)\)")
ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\](?:\{(?P<layout>[^}]*)\})?")
QUIET = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier",
         "after-all", "add-dependency", "copy"}
KINDS = ("copy", "slice", "dynamic-slice", "dynamic-update-slice")
WAYS = ("to_device", "to_host")


def nbytes(array):
    n = 1
    for d in filter(None, array.group("dims").split(",")):
        n *= int(d)
    return n * int(re.sub("[a-z]", "", array.group("dtype")) or 8) // 8


def computations(text):
    found, lines = {}, None
    for line in text.splitlines():
        if not line.startswith((" ", "}")) and line.rstrip().endswith("{") and "(" in line:
            lines = found.setdefault(line.split(" ")[1 if line.startswith("ENTRY") else 0], [])
        elif line.startswith("}"):
            lines = None
        elif lines is not None:
            lines.append(line)
    return found


def copies(lines):
    started, compute = {}, []
    for n, line in enumerate(lines):
        m = LINE.match(line)
        if m is None:
            continue
        op = m.group("op")
        if op.endswith("-start") and op[:-6] in KINDS:
            arrays = list(ARRAY.finditer(m.group("type")))
            host = ["S(5)" in (a.group("layout") or "") for a in arrays]
            if any(host):
                result = len(arrays) - 2  # (operands..., result, context)
                moved = arrays[1] if op == "dynamic-update-slice-start" else arrays[result]
                started[m.group("name")] = {"way": WAYS[host[result]], "bytes": nbytes(moved),
                                            "start": n, "done": -1}
        elif op.endswith("-done"):
            name = m.group("args").split(",")[0].strip().lstrip("%")
            if name in started:
                started[name]["done"] = n
        elif op not in QUIET:
            compute.append(n)
    return list(started.values()), compute


def link_seconds(moves, bandwidth=14e9):
    events = sorted([(c["start"], 0, k) for k, c in enumerate(moves)]
                    + [(c["done"], 1, k) for k, c in enumerate(moves)])
    clock, lanes, finish = 0.0, dict.fromkeys(WAYS, 0.0), {}
    for _, done, k in events:
        c = moves[k]
        if done:
            clock = max(clock, finish[k])
        else:
            finish[k] = lanes[c["way"]] = max(clock, lanes[c["way"]]) + c["bytes"] / bandwidth
    return max([clock, *finish.values()])


def summary(moves, compute):
    out = {}
    for way in WAYS:
        these = [c for c in moves if c["way"] == way]
        both = [c for c in these if any(o["way"] != way and o["start"] < c["done"]
                                         and c["start"] < o["done"] for o in moves)]
        out[way] = {"copies": len(these), "bytes": sum(c["bytes"] for c in these),
                    "under_compute": sum(any(c["start"] < i < c["done"] for i in compute)
                                         for c in these),
                    "both_ways": len(both), "bytes_both_ways": sum(c["bytes"] for c in both)}
        now = peak = 0
        for _, step in sorted([(c["start"], 1) for c in these] + [(c["done"], -1) for c in these]):
            now += step
            peak = max(peak, now)
        out[way]["in_flight"] = peak
    ways = [out[w]["bytes"] for w in WAYS]
    out.update(link_ms=round(1e3 * link_seconds(moves), 1),
               full_duplex_ms=round(1e3 * max(ways) / 14e9, 1),
               serial_ms=round(1e3 * sum(ways) / 14e9, 1))
    return out


if __name__ == "__main__":
    for name, lines in computations(open(sys.argv[1]).read()).items():
        moves, compute = copies(lines)
        if len(moves) >= 4:
            print(json.dumps({"computation": name, **summary(moves, compute)}))

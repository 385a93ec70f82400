"""The host link in a profiled step (`profile.py`'s gzipped ops): per direction, the copies,
their bytes, the time any is in flight and how many at once; both directions at once; the
time ops computed and waited, in the trace's first step.

    python links.py profile-MODE-8-1.jsonl.gz [--by-shape]
"""

import collections
import gzip
import json
import re
import sys

BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}
SHAPE = re.compile(r"(f32|s32|u32|bf16|f16|s8|u8|pred)\[([0-9,]*)\]\{([^}]*)\}")


def shapes(text: str) -> list[tuple[int, bool]]:
    """Each array in an HLO text: its bytes, and whether it is in host memory (`S(5)`)."""
    out = []
    for m in SHAPE.finditer(text):
        n = BYTES[m.group(1)]
        for d in filter(None, m.group(2).split(",")):
            n *= int(d)
        out.append((n, "S(5)" in m.group(3)))
    return out


def direction(name: str) -> tuple[str, int]:
    """An async op's direction over the link ("to_host", "to_device" or "") and bytes."""
    head, _, body = name.partition(" = ")
    kind = head.lstrip("%").split(".")[0]
    arrays = [a for a in shapes(body) if a[0] > 4]
    if kind == "copy-start" or kind == "slice-start":
        (_, src_host), (dst, dst_host) = arrays[-1], arrays[0]
        if kind == "slice-start":
            (_, src_host), (dst, dst_host) = arrays[0], arrays[1]
        if dst_host != src_host:
            return ("to_host" if dst_host else "to_device"), dst
    elif kind == "dynamic-slice-start" and arrays[0][1] and not arrays[1][1]:
        return "to_device", arrays[1][0]
    elif kind == "dynamic-update-slice-start" and arrays[0][1] and not arrays[1][1]:
        return "to_host", arrays[1][0]
    return "", 0


def union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def merged(spans: list[tuple[float, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def main(path: str, by_shape: bool) -> None:
    events = [json.loads(line) for line in gzip.open(path, "rt")]
    half = max(e[2] + e[3] for e in events) / 2  # (two steps were traced: the first)
    ops = [e for e in events if e[0] == "XLA Ops" and e[2] < half]
    copies: dict[str, list[tuple[float, float, int, str]]] = {"to_host": [], "to_device": []}
    for _, name, start, took, _ in (e for e in events if e[0] == "Async XLA Ops" and e[2] < half):
        way, size = direction(name)
        if way:
            copies[way].append((start, start + took, size, name))
    print(f"step {max(e[2] + e[3] for e in ops) / 1e3:.1f} ms")
    for way, spans in copies.items():
        gb, busy = sum(s[2] for s in spans) / 1e9, union([s[:2] for s in spans]) / 1e3
        points = sorted([(a, 1) for a, *_ in spans] + [(b, -1) for _, b, *_ in spans])
        flight: dict[int, float] = collections.Counter()
        now, last = 0, 0.0
        for t, k in points:
            if now:
                flight[now] += (t - last) / 1e3
            now, last = now + k, t
        print(f"{way}: {len(spans)} copies, {gb:.3f} GB, in flight {busy:.1f} ms "
              f"({gb / busy * 1e3:.1f} GB/s), ms by copies in flight "
              f"{ {k: round(v, 1) for k, v in sorted(flight.items())} }")
    host, device = merged([s[:2] for s in copies["to_host"]]), merged([s[:2] for s in copies["to_device"]])
    both = sum(max(0.0, min(h[1], d[1]) - max(h[0], d[0])) for h in host for d in device)
    print(f"both directions at once {both / 1e3:.1f} ms")
    heads = [e[1].split(" = ")[0] for e in ops]
    compute = [(e[2], e[2] + e[3]) for e, h in zip(ops, heads)
               if "-done" not in h and "-start" not in h
               and not h.lstrip("%").startswith(("while", "conditional", "call", "cond"))]
    waits = [(e[2], e[2] + e[3]) for e, h in zip(ops, heads) if "-done" in h]
    print(f"computing {union(compute) / 1e3:.1f} ms, waiting on a copy {union(waits) / 1e3:.1f} ms")
    if by_shape:
        table: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0, 0])
        for way, spans in copies.items():
            for a, b, size, name in spans:
                head, _, body = name.partition(" = ")
                key = (way, head.lstrip("%").split(".")[0] + " " + re.sub(r"\{[^}]*\}", "", body)[:90])
                table[key][0] += 1
                table[key][1] += size / 1e6
                table[key][2] += (b - a) / 1e3
        for (way, what), (n, mb, ms) in sorted(table.items(), key=lambda kv: -kv[1][1]):
            print(f"{way:9} n={n:<4d} MB={mb:<8.1f} ms={ms:<7.1f} {what}")


if __name__ == "__main__":
    main(sys.argv[1], "--by-shape" in sys.argv[2:])

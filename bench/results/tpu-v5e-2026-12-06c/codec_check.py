"""The 8-bit state's codec on the default backend: exact, and how fast.

    python bench/results/tpu-v5e-2026-12-06c/codec_check.py [VALUES]

Decodes all 256 codes of each map (`quantize.lookup`, and `_decoded` itself) and encodes
every midpoint, its float32 neighbours, the map's entries, special values and 1M random
values (`_encoded`), comparing bitwise with NumPy on the host (the map as a table,
`np.searchsorted` over the midpoints). Then times the comparison-based forms the codec
replaced (`_selected`, `_counted`) against `_decoded` and `_encoded` on VALUES values
(default 64M on an accelerator, 1M on the CPU): the median of 5 calls after one, each to
`block_until_ready`. Prints one JSON line (appended to $OUT/codec_check.jsonl if set).
"""

import json
import os
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eqx_offload._optim import quantize as q


def inputs(signed: bool, rng: np.random.Generator) -> np.ndarray:
    """Values whose counts decide exactness: each midpoint and the float32 on either side
    of it, the entries, special values, and 1M random values over many magnitudes."""
    mids = q.midpoints(signed)
    special = np.array([0.0, -0.0, 1, -1, 2, -2, np.inf, -np.inf, np.nan, -np.nan,
                        1e-45, -1e-45, 1e-38, -1e-38, 1e-7, -1e-7], np.float32)
    size = 1_000_000
    random = (rng.uniform(-1, 1, size) * 10.0 ** rng.uniform(-8, 0, size)).astype(np.float32)
    return np.concatenate([mids, np.nextafter(mids, np.float32(2)),
                           np.nextafter(mids, np.float32(-2)), q._map(signed),
                           -q._map(signed), special, random]).astype(np.float32)


def median_ms(fn: Any, arg: Any) -> float:
    fn(arg).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn(arg).block_until_ready()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 3)


def main() -> None:
    backend = jax.default_backend()
    size = int(sys.argv[1]) if len(sys.argv) > 1 else (1 << 20 if backend == "cpu" else 1 << 26)
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {"backend": backend, "device": jax.devices()[0].device_kind,
                              "jax": jax.__version__, "values": size}
    codes = rng.integers(0, 256, size, dtype=np.uint8)
    device_codes = jnp.asarray(codes)
    scaled = jnp.asarray((rng.uniform(-1, 1, size) * 10.0 ** rng.uniform(-7, 0, size))
                         .astype(np.float32))
    for signed in (True, False):
        name = "signed" if signed else "unsigned"
        table = q._map(signed)
        every = jnp.arange(256, dtype=jnp.int32)
        for label, fn in (("lookup", q.lookup), ("decoded", q._decoded)):
            got = np.asarray(jax.jit(fn, static_argnums=1)(every, signed))
            result[f"{label}_{name}_mismatches"] = int(np.sum(got.view(np.uint32)
                                                              != table.view(np.uint32)))
        x = inputs(signed, rng)
        want = np.where(np.isnan(x), 0, np.searchsorted(q.midpoints(signed), x, side="right"))
        got = np.asarray(jax.jit(q._encoded, static_argnums=1)(jnp.asarray(x), signed))
        result[f"encoded_{name}_mismatches"] = int(np.sum(got != want))
        result[f"encoded_{name}_checked"] = int(x.size)

        jtable, jmids = jnp.asarray(table), jnp.asarray(q.midpoints(signed))
        result[f"ms_decode_old_{name}"] = median_ms(
            jax.jit(lambda c: q._selected(c.astype(jnp.int32), jtable)), device_codes)
        result[f"ms_decode_new_{name}"] = median_ms(
            jax.jit(lambda c: q._decoded(c.astype(jnp.int32), signed)), device_codes)
        y = scaled if signed else jnp.abs(scaled)
        result[f"ms_encode_old_{name}"] = median_ms(
            jax.jit(lambda v: q._counted(v, jmids).astype(jnp.uint8)), y)
        result[f"ms_encode_new_{name}"] = median_ms(
            jax.jit(lambda v: q._encoded(v, signed).astype(jnp.uint8)), y)
    result["exact"] = all(v == 0 for k, v in result.items() if k.endswith("mismatches"))
    line = json.dumps(result)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "codec_check.jsonl"), "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()

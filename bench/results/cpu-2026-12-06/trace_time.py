"""Seconds to trace and lower one step of `offloaded(adamw)` on the CPU, for the default
(`group_bytes="auto"`) and the whole state (`group_bytes=None`), through
`eqx_offload.filter_jit` (which knows the platform it lowers for) and `jax.jit` (which
does not). Medians of interleaved repetitions, each with a fresh optimizer and step.

    JAX_PLATFORMS=cpu python bench/trace_time.py --leaves 48 --repeats 7
"""

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import eqx_offload


def lower_once(jit: str, group_bytes: Any, params: Any) -> float:
    opt = eqx_offload.offloaded(optax.adamw(1e-3), group_bytes=group_bytes)
    state = opt.init(params)

    def step(params: Any, state: Any, grads: Any) -> Any:
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    start = time.perf_counter()
    if jit == "filter_jit":
        eqx_offload.filter_jit(step, donate="all").lower(params, state, params)
    else:
        jax.jit(step).lower(params, state, params)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    params = {f"w{i}": jnp.ones((64, 64)) for i in range(args.leaves)}
    cases = [(j, g) for j in ("filter_jit", "jax.jit") for g in ("auto", None)]
    times: dict[Any, list[float]] = {c: [] for c in cases}
    lower_once("filter_jit", "auto", params)  # (warm-up: imports, first compilations)
    for _ in range(args.repeats):
        for case in cases:
            times[case].append(lower_once(*case, params))
    print(f"JAX {jax.__version__}, {args.leaves} leaves, {args.repeats} repetitions")
    for (jit, group_bytes), t in times.items():
        print(f"{jit:>10} group_bytes={group_bytes!s:>4}: {statistics.median(t):.3f} s "
              f"[{min(t):.3f}, {max(t):.3f}]")


if __name__ == "__main__":
    main()

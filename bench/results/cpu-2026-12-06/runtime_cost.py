"""What the runtime checks (beartype through jaxtyping's import hook) cost.

    python bench/runtime_cost.py [--runs 5]

Each measurement runs in a fresh interpreter, in three modes: `eqx_offload` imported
under `jaxtyping.install_import_hook("eqx_offload", "beartype.beartype")` (every function
of the package checked, what the test suite does), after
`eqx_offload.install_runtime_checks()` (its public functions checked), and without
checks:

- `trace_ms`: the fastest of 10 traces of the step's body (`eqx.filter_make_jaxpr`):
  what the checks cost a jitted step, once per compilation.
- `first_step_cpu_s`: CPU time of the first call of a jitted training step (an
  `eqx.nn.MLP` with `offloaded(optax.adamw)` under `eqx_offload.filter_jit`): tracing,
  where the checks run, plus compiling, which they do not touch. (CPU time, not wall
  time: on a shared machine the wall time of a one-off call is mostly other jobs.)
- `step_us`: the fastest of 50 later calls of the same step (compiled: what remains is
  `filter_jit`'s dispatch in Python, whose helpers are checked).
- `to_host_us`: the fastest of 200 eager `to_host` calls on a dict of 8 small arrays
  (the checks run on every eager call).

Prints the median over `--runs` interpreters per mode.
"""

import argparse
import json
import statistics
import subprocess
import sys


CHILD = r"""
import json, sys, time
if sys.argv[1] == "hook":
    import jaxtyping
    with jaxtyping.install_import_hook("eqx_offload", "beartype.beartype"):
        import eqx_offload
elif sys.argv[1] == "install":
    import eqx_offload
    eqx_offload.install_runtime_checks()
else:
    import eqx_offload
import equinox as eqx, jax, jax.numpy as jnp, optax

model = eqx.nn.MLP(64, 64, 256, 4, key=jax.random.key(0))
opt = eqx_offload.offloaded(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))
state = opt.init(eqx.filter(model, eqx.is_array))

def body(model, state, x):
    grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), state

step = eqx_offload.filter_jit(body, donate="all-except-first")
x = jnp.ones((32, 64))
traces = []
for _ in range(10):
    start = time.perf_counter()
    eqx.filter_make_jaxpr(body)(model, state, x)
    traces.append(time.perf_counter() - start)
start = time.process_time()
model, state = step(model, state, x)
jax.block_until_ready((model, state))
first = time.process_time() - start
times = []
for _ in range(50):
    start = time.perf_counter()
    model, state = step(model, state, x)
    jax.block_until_ready((model, state))
    times.append(time.perf_counter() - start)

tree = {str(i): jnp.ones((16, 16)) for i in range(8)}
jax.block_until_ready(eqx_offload.to_host(tree))
moves = []
for _ in range(200):
    start = time.perf_counter()
    jax.block_until_ready(eqx_offload.to_host(tree))
    moves.append(time.perf_counter() - start)
print(json.dumps({"trace_ms": min(traces) * 1e3, "first_step_cpu_s": first, "step_us": min(times) * 1e6,
                  "to_host_us": min(moves) * 1e6}))
"""


def measure(mode: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True,
                         text=True, check=True).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"plain": [], "hook": [], "install": []}
    for _ in range(args.runs):
        for mode in results:  # interleaved, so that machine load hits both alike
            results[mode].append(measure(mode))
    medians = {
        mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for mode, runs in results.items()
    }
    for key in medians["plain"]:
        plain, hook, install = (medians[m][key] for m in ("plain", "hook", "install"))
        print(f"{key:>16}: without checks {plain:10.3f}   hook on the package {hook:10.3f} "
              f"({hook - plain:+.3f})   install_runtime_checks() {install:10.3f} "
              f"({install - plain:+.3f})")


if __name__ == "__main__":
    main()

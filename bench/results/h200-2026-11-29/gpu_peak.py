"""Peak device memory of one optimizer step in four modes, in one short run.

    python bench/gpu_peak.py                 # on a GPU: 32 x 4096^2 float32 params (2 GiB),
                                             # Adam state 4 GiB; about two minutes
    python bench/gpu_peak.py --quick         # tiny, for the CPU backend (the test suite)

Modes (each in its own process, so that `device.memory_stats()["peak_bytes_in_use"]`,
which JAX cannot reset, belongs to that mode alone):

- `baseline`: `optax.adam`, state on the device.
- `offloaded`: `eqx_offload.offloaded(optax.adam)`: state on host between steps, the
  whole state on the device during the update.
- `streamed`: `offloaded(..., group_bytes=0)`: one parameter's state on the device at a
  time.
- `host_compute`: `offloaded(..., compute="host")`: the update runs on the host CPU.

(`streamed` and `host_compute` take their `offloaded` options from the benchmark's mode
table, `eqx_offload.cli.modes.MODES`, so that both measure the same thing.)

The step is the optimizer step alone, `params, state <- apply(update(grads, state,
params))`, jitted with `eqx_offload.filter_jit(donate="all-except-first")` (gradients are
kept for the next step, params and state are donated). The state is created on the
CPU backend and placed straight into its memory kinds, so no mode ever held the whole
state on the device before its step runs.

For every mode it records: `compiled.memory_analysis()` of
`eqx_offload.filter_jit(step).lower(...).compile()` (argument, output, alias, temp,
host_* and peak sizes: XLA's own plan); the compilations the steps caused (counted
through `jax.monitoring`); `device.memory_stats()` (bytes in use before the
first step, and the allocator's peak over the steps: what the device really held); step
times; a checksum of the final params and state, compared with the baseline's (the
CPU computes `host_compute`, so on a GPU its results may differ from the GPU's in the
last bits); where the state lives; and for `streamed` the `StreamPlan`.
Everything goes to a JSON file and a Markdown table on stdout.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional


MODES = ("baseline", "offloaded", "streamed", "host_compute")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, REPO)
GiB = 1 << 30
MiB = 1 << 20


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import numpy as np
    import optax

    import eqx_offload
    from eqx_offload.cli.measure import CompileCounter, counting, memory_analysis_dict
    from eqx_offload.cli.modes import MODES as BENCH_MODES

    result: dict[str, Any] = {"mode": args.child, "error": None}
    device = jax.devices()[0]
    result["device"] = f"{device.platform}:{device.device_kind}"
    inner = optax.adam(1e-3)
    if args.child == "baseline":
        opt = inner
    elif args.child == "offloaded":
        opt = eqx_offload.offloaded(inner)
    else:
        opt = eqx_offload.offloaded(inner, **(BENCH_MODES[args.child].options or {}))

    rng = np.random.default_rng(0)
    shape = (args.width, args.width)
    host_params = {f"w{i:02d}": rng.standard_normal(shape, np.float32) for i in range(args.leaves)}
    params = jax.device_put(host_params, device)
    grads = jax.device_put(
        {k: (0.01 * v + 0.001).astype(np.float32) for k, v in host_params.items()}, device
    )
    # The state: made on the CPU backend, then put straight into its memory kinds here.
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        cpu_state = opt.init(jax.device_put(host_params, cpu))
    kinds = jax.tree.map(lambda x: x.sharding.memory_kind, cpu_state)
    on_device = jax.sharding.make_single_device_sharding(device)
    state = jax.tree.map(
        lambda x, kind: jax.device_put(np.asarray(x), on_device.with_memory_kind(
            kind if kind in ("pinned_host", "unpinned_host") else device.default_memory().kind
        )),
        cpu_state, kinds,
    )
    del cpu_state
    report = eqx_offload.memory_report(state)
    result["opt_state_host_bytes"] = report.host_bytes
    result["opt_state_device_bytes"] = report.device_bytes
    if args.child == "streamed":
        plan = eqx_offload.stream.stream_plan(inner, grads, state.inner_state, params, group_bytes=0)
        result["stream_plan"] = {
            "groups": len(plan.groups),
            "max_group_nbytes": plan.max_group_nbytes,
            "total_nbytes": plan.total_nbytes,
        }

    def step(grads: Any, params: Any, state: Any) -> Any:
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    jitted = eqx_offload.filter_jit(step, donate="all-except-first")
    stats_before = device.memory_stats()
    seconds = []
    counter = CompileCounter()
    with counting(counter):
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            params, state = jitted(grads, params, state)
            jax.block_until_ready((params, state))
            if i >= args.warmup:
                seconds.append(time.perf_counter() - start)
    stats_after = device.memory_stats()
    # (After the peak is read: this compiles the step once more, outside the count.)
    result["memory_analysis"] = memory_analysis_dict(
        jitted.lower(grads, params, state).compile())
    result["compilations"] = counter.count
    if stats_before is None or stats_after is None:
        result["device_memory_stats"] = None
    else:
        result["device_memory_stats"] = {
            "bytes_in_use_before": stats_before.get("bytes_in_use"),
            "peak_bytes_in_use": stats_after.get("peak_bytes_in_use"),
            "step_peak_above_start": (
                stats_after.get("peak_bytes_in_use", 0) - stats_before.get("bytes_in_use", 0)
            ),
            "peak_before_steps": stats_before.get("peak_bytes_in_use"),
        }
    result["step_seconds"] = seconds
    result["median_step_seconds"] = float(np.median(seconds)) if seconds else None
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves((params, state)):
        digest.update(np.ascontiguousarray(np.asarray(jax.device_get(leaf))).tobytes())
    result["checksum"] = digest.hexdigest()
    return result


def _run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    # Let the allocator grow on demand, so that its peak is the program's peak.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    command = [
        sys.executable, os.path.abspath(__file__), "--child", mode,
        "--leaves", str(args.leaves), "--width", str(args.width),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {args.timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"mode": mode, "error": f"exit code {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def _fmt(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    return f"{n / MiB:,.1f} MiB"


def markdown(result: dict[str, Any]) -> str:
    rows = [
        f"{result['leaves']} x {result['width']}^2 float32 params "
        f"({_fmt(result['params_bytes'])}), Adam state {_fmt(result['opt_state_bytes'])}, "
        f"on {result['modes'][0].get('device', '?')}",
        "",
        "| mode | step peak above start (memory_stats) | temp (memory_analysis) | "
        "peak (memory_analysis) | host temp | median step | bitwise = baseline | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["modes"]:
        ma = row.get("memory_analysis") or {}
        ms = row.get("device_memory_stats") or {}
        seconds = row.get("median_step_seconds")
        error = row.get("error")
        rows.append(
            f"| {row['mode']} | {_fmt(ms.get('step_peak_above_start'))} | "
            f"{_fmt(ma.get('temp_size_in_bytes'))} | {_fmt(ma.get('peak_memory_in_bytes'))} | "
            f"{_fmt(ma.get('host_temp_size_in_bytes'))} | "
            f"{'n/a' if seconds is None else f'{seconds * 1e3:,.1f} ms'} | "
            f"{row.get('bitwise_equal_to_baseline')} | "
            f"{'' if error is None else error.splitlines()[-1][:80]} |"
        )
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the CPU backend")
    parser.add_argument("--leaves", type=int, default=None, help="number of square params (32)")
    parser.add_argument("--width", type=int, default=None, help="side of each param (4096)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps (1)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--timeout", type=int, default=240, help="seconds per mode (240)")
    parser.add_argument("--out", default="gpu_peak.json", help="JSON output file")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        defaults = {"leaves": 4, "width": 64, "steps": 2}
    else:
        defaults = {"leaves": 32, "width": 4096, "steps": 5}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.child:
        try:
            print(json.dumps(_child(args)))
        except Exception as e:  # noqa: BLE001 - reported in the JSON, next mode still runs
            import traceback

            print(json.dumps({"mode": args.child, "error": traceback.format_exc()[-3000:] or repr(e)}))
        return 0

    params_bytes = args.leaves * args.width * args.width * 4
    result: dict[str, Any] = {
        "leaves": args.leaves,
        "width": args.width,
        "params_bytes": params_bytes,
        "opt_state_bytes": 2 * params_bytes,
        "quick": args.quick,
        "modes": [],
    }
    for mode in args.modes:
        start = time.perf_counter()
        row = _run_mode(mode, args)
        row["wall_seconds"] = time.perf_counter() - start
        result["modes"].append(row)
        print(f"{mode}: {'ok' if row.get('error') is None else 'ERROR'} "
              f"({row['wall_seconds']:.0f} s)", file=sys.stderr, flush=True)
        base = next((r for r in result["modes"] if r["mode"] == "baseline"), None)
        for r in result["modes"]:
            r["bitwise_equal_to_baseline"] = (
                None if base is None or "checksum" not in r or "checksum" not in base
                else r["checksum"] == base["checksum"]
            )
        with open(args.out, "w") as f:  # after every mode: a cut-short run keeps what it has
            json.dump(result, f, indent=1)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What XLA:TPU estimates the device work of an `offloaded(adamw)` update costs, planned
for a TPU v5e without one (libtpu's deviceless compile): the update of the 542M Llama's
parameters (`bench/harness.py`'s d=2048, 8 layers, ffn 5632, vocabulary 32000; its state
in host memory), or `--piece` the codec alone on one `(2, 2048, 5632)` piece. Sums the
`estimated_cycles` XLA:TPU writes on each instruction of the optimized program (at
1.5 GHz), in all and by instruction (a fusion by its name's stem). Prints one JSON line.

    JAX_PLATFORMS=cpu TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_WORKER_HOSTNAMES=localhost \
        TPU_SKIP_MDS_QUERY=1 python bench/results/tpu-v5e-2026-12-06e/codec_cost.py --host-dtype int8

Estimates of a compiler, not measurements."""

import argparse
import collections
import json
import pathlib
import re
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_offload
from eqx_offload._optim import quantize as q

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import harness
from llama import Llama


CLOCK = 1.5e9
_CYCLES = re.compile(r'"estimated_cycles":"?(\d+)')
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=.*?\s([a-z][a-z0-9\-]*)\(")


def cycles(text: str) -> dict[str, Any]:
    """The entry's and its loops' instructions' `estimated_cycles`, summed by kind."""
    by: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        found, named = _CYCLES.search(line), _NAME.match(line)
        if found and named:
            name, op = named.groups()
            stem = re.sub(r"[.\d]+$", "", name) if op == "fusion" else op
            by[stem] += int(found.group(1))
    total = sum(by.values())
    return {"ms": round(1e3 * total / CLOCK, 2),
            "top": {k: round(1e3 * v / CLOCK, 2) for k, v in by.most_common(12)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host-dtype", help="int8 (8-bit state), or none for fp32")
    parser.add_argument("--piece", action="store_true", help="the codec alone on a piece")
    parser.add_argument("--dump", help="write the optimized HLO to this file")
    args = parser.parse_args()
    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    mesh = Mesh([device], ("x",))

    def on(s: Any, kind: Any = None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(
            mesh, P(), memory_kind=kind or getattr(s.sharding, "memory_kind", None)))

    start = time.perf_counter()
    if args.piece:
        x = on(jax.ShapeDtypeStruct((2, 2048, 5632), jnp.float32))
        spec = q.Quantized(jnp.dtype(jnp.float32), x.shape, True)
        packed = on(jax.ShapeDtypeStruct(spec.packed, q.CODE_DTYPE))
        text = {}
        for name, fn, arg in (("quantize", lambda a: q.quantize(a, True), x),
                              ("dequantize", lambda a: q.dequantize(a, spec), packed)):
            text[name] = jax.jit(fn).trace(arg).lower(lowering_platforms=("tpu",)).compile().as_text()
        result: dict[str, Any] = {k: cycles(t) for k, t in text.items()}
    else:
        shape = harness.llama_shape(2048, 8, 256, 1)
        model = eqx.filter_eval_shape(Llama, shape, jax.random.key(0))
        params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct)
                             and jnp.issubdtype(x.dtype, jnp.floating))
        host_dtype = None if args.host_dtype in (None, "none") else jnp.dtype(args.host_dtype)
        opt = eqx_offload.offloaded(optax.adamw(1e-3), host_dtype=host_dtype)
        cpu = NamedSharding(Mesh(jax.devices("cpu")[:1], ("x",)), P())
        p = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu), params)
        state = eqx_offload.checkpoint.abstract_init(opt, p)

        def step(params: Any, state: Any, grads: Any) -> Any:
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        jitted = eqx_offload.filter_jit(step, donate="all")
        step_args = jax.tree.map(on, (p, state, p))
        compiled = jitted.lower_for(("tpu",), step_args, {}).compile()
        text = {"update": compiled.as_text()}
        result = cycles(text["update"])
    if args.dump:
        pathlib.Path(args.dump).write_text("\n\n".join(text.values()))
    result.update(host_dtype=args.host_dtype, piece=args.piece, jax=jax.__version__,
                  seconds=round(time.perf_counter() - start, 1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

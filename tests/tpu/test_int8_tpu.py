"""8-bit optimizer state (`offloaded(..., host_dtype=jnp.int8)`) compiles for a TPU v5e
(without one), in each way the state comes to the device, and XLA:TPU's memory analysis
holds about a quarter of fp32 state's bytes in host memory.

XLA:TPU refuses some narrow shapes in host memory (a bf16 `(L, d)` buffer read a row at a
time); the packed codes keep every leading axis of their leaf, and the streamed update
reads and writes whole rows of a stacked leaf, here in pieces of one layer
(`group_bytes=1 << 16`)."""

import functools
import pathlib
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_offload
from helpers import TPU_ENV
from isolated import result_of, run_isolated


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from llama import Llama, llama_loss, LlamaShape  # (bench/: scripts of the repository)


# (Oldest only, the chip's JAX; the newest compiles 8-bit state in test_codec_v5e.py.)

# Rows of 512 and 1024 values (128 and 256 words of codes: whole TPU tiles of 128 lanes;
# rows of 256 values, 64 words, would be padded to twice their bytes).
SHAPE = LlamaShape("tiny", width=512, layers=2, heads=4, kv_heads=2, ffn=1024, vocab=512,
                   seq=32, batch=2)
ADAMW = optax.adamw(1e-3)
INT8 = functools.partial(eqx_offload.offloaded, host_dtype=jnp.int8)
OPTIMIZERS = {
    "fp32": lambda: ("optax", eqx_offload.offloaded(ADAMW)),
    "int8": lambda: ("optax", INT8(ADAMW)),
    "int8-whole": lambda: ("optax", INT8(ADAMW, group_bytes=None)),
    "int8-rows": lambda: ("optax", INT8(ADAMW, group_bytes=1 << 16)),
    "int8-master": lambda: ("master", eqx_offload.master_weights(ADAMW, offload=INT8)),
}


def _step(name: str) -> tuple[Any, tuple[Any, ...]]:
    kind, opt = OPTIMIZERS[name]()
    model = Llama(SHAPE, jax.random.key(0))
    tokens = jnp.zeros((SHAPE.batch, SHAPE.seq + 1), jnp.int32)
    if kind == "master":
        model, state = opt.init(model)

        def master_step(m: Any, state: Any, tokens: jax.Array) -> Any:
            return opt.update(eqx.filter_grad(llama_loss)(m, tokens), state, m)

        return master_step, (model, state, tokens)
    state = opt.init(eqx.filter(model, eqx.is_array))

    def step(m: Any, state: Any, tokens: jax.Array) -> Any:
        updates, state = opt.update(eqx.filter_grad(llama_loss)(m, tokens), state,
                                    eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, updates), state

    return step, (model, state, tokens)


def compile_each(names: list[str]) -> dict[str, Any]:
    """(In a child process, with `TPU_ENV` set.) Each step compiled for a v5e's first
    chip: its memory analysis, or its error."""
    from jax.experimental import topologies

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    mesh = Mesh([device], ("x",))

    def abstract(x: Any) -> Any:
        if not eqx.is_array(x):
            return x
        sharding = NamedSharding(mesh, P(), memory_kind=x.sharding.memory_kind)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    found: dict[str, Any] = {}
    for name in names:
        step, args = _step(name)
        try:
            analysis = eqx_offload.filter_jit(step, donate="all").lower_for(
                ("tpu",), jax.tree.map(abstract, args), {}).compile().memory_analysis()
            found[name] = {f: getattr(analysis, f) for f in (
                "argument_size_in_bytes", "temp_size_in_bytes", "host_argument_size_in_bytes")}
        except Exception as error:  # reported by the test
            found[name] = f"{type(error).__name__}: {error}"[:2000]
    return found


PACKAGE = str(pathlib.Path(eqx_offload.__file__).resolve().parents[1])


def test_8bit_state_compiles_for_a_v5e_with_a_quarter_of_the_host_bytes(tpu: Any) -> None:
    found = result_of(run_isolated(compile_each, list(OPTIMIZERS),
                                   env={**TPU_ENV, "PYTHONPATH": PACKAGE}))
    failed = {name: r for name, r in found.items() if isinstance(r, str)}
    assert not failed, "\n\n".join(f"{name}: {r}" for name, r in failed.items())
    fp32 = found["fp32"]["host_argument_size_in_bytes"]
    for name in ("int8", "int8-whole", "int8-rows"):
        host = found[name]["host_argument_size_in_bytes"]
        # Codes and scales of the large leaves (1 + 1/64 bytes a value, a tile's padding);
        # the small ones (norms, < 4096 values) stay fp32.
        assert fp32 / 4 < host < fp32 / 3, (name, host, fp32)
        assert found[name]["argument_size_in_bytes"] == found["fp32"]["argument_size_in_bytes"]
    # The master weights stay fp32: the int8 state saves less than a quarter of the whole.
    master = found["int8-master"]["host_argument_size_in_bytes"]
    assert fp32 / 2 < master < fp32, (master, fp32)

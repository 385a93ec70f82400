"""Every documented offload mode compiles for a TPU v5e (without one), and XLA:TPU's
memory analysis shows the bytes where the docs say: a small Llama-style decoder
(bench/llama.py: RMSNorm, rotary attention, SwiGLU, stacked blocks run by `scan_layers`)
lowered through `eqx_offload.filter_jit(...).lower_for(("tpu",), ...)` from abstract
arguments whose shardings are on the topology's device (their memory kinds kept)."""

import functools
import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_offload
from helpers import TPU_ENV
from isolated import run_isolated


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from llama import Llama, llama_loss, LlamaShape  # (bench/: scripts of the repository)


pytestmark = pytest.mark.both  # (libtpu pins its JAX: both environments)

SHAPE = LlamaShape("tiny", width=128, layers=2, heads=2, kv_heads=1, ffn=256, vocab=256,
                   seq=32, batch=2)
TOKENS = jnp.zeros((SHAPE.batch, SHAPE.seq + 1), jnp.int32)


def _model(dtype: Any = None, blocks: str = "device", offload_input: bool = False) -> Llama:
    model = Llama(SHAPE, jax.random.key(0), offload_input=offload_input, dtype=dtype)
    if blocks == "host":
        model = eqx.tree_at(lambda m: m.blocks, model, replace_fn=eqx_offload.to_host)
    return model


Step = tuple[Callable[..., Any], tuple[Any, ...]]  # a step and its arguments


def _optax_step(opt: optax.GradientTransformation, **model: Any) -> Step:
    m = _model(**model)
    state = opt.init(eqx.filter(m, eqx.is_array))

    def step(m: Llama, state: Any, tokens: jax.Array) -> Any:
        grads = eqx.filter_grad(llama_loss)(m, tokens)
        updates, state = opt.update(grads, state, eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, updates), state

    return step, (m, state, TOKENS)


def _wrapped_step(wrapper: Any, **model: Any) -> Step:
    """A step of `host_weights_optimizer(...)` or `master_weights(...)` (`update` returns the model)."""
    m = _model(**model)
    if isinstance(wrapper, eqx_offload.types.MasterWeights):
        m, state = wrapper.init(m)
    else:
        state = wrapper.init(m)

    def step(m: Llama, state: Any, tokens: jax.Array) -> Any:
        return wrapper.update(eqx.filter_grad(llama_loss)(m, tokens), state, m)

    return step, (m, state, TOKENS)


class _Quantised(eqx.Module):
    """A stacked layer whose weights are stored narrow (int8 or fp8) with a bf16 scale
    per output, widened on the device."""

    weight: jax.Array
    bias: jax.Array
    scale: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight.astype(jnp.bfloat16) * self.scale[:, None]
        return x + jnp.tanh(w @ x + self.bias.astype(jnp.bfloat16))


def _quantised_step(dtype: Any) -> Step:
    """Gradients (of the scales) through narrow weights in host memory."""
    n, d = SHAPE.layers, SHAPE.width
    layers = eqx_offload.to_host(_Quantised(
        jnp.ones((n, d, d), dtype), jnp.ones((n, d), dtype), jnp.ones((n, d), jnp.bfloat16)))

    def step(layers: _Quantised, x: jax.Array) -> Any:
        def loss(layers: _Quantised) -> jax.Array:
            out = jax.vmap(lambda h: eqx_offload.scan_layers(layers, h))(x)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return eqx.filter_grad(loss)(layers)

    return step, (layers, jnp.ones((SHAPE.batch, d), jnp.bfloat16))


def _host_weights_step() -> Step:
    """A bf16 MLP whose hidden layer waits in host memory (`host_weights`), trained
    with `host_weights_optimizer`."""
    mlp = eqx.nn.MLP(SHAPE.width, SHAPE.width, SHAPE.ffn, 2, key=jax.random.key(1))
    mlp = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, mlp)
    mlp = eqx.tree_at(lambda m: m.layers[1], mlp, replace_fn=eqx_offload.host_weights)
    hp = eqx_offload.host_weights_optimizer(ADAMW)

    def step(mlp: eqx.nn.MLP, state: Any, x: jax.Array) -> Any:
        def loss(m: eqx.nn.MLP) -> jax.Array:
            return jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2)
        return hp.update(eqx.filter_grad(loss)(mlp), state, mlp)

    return step, (mlp, hp.init(mlp), jnp.ones((SHAPE.batch, SHAPE.width), jnp.bfloat16))


def _vector_inputs_step() -> Step:
    """bf16 stacked layers in host memory whose inputs are vectors, each kept for the
    backward pass (`offload_input`), differentiated without `vmap`."""
    keys = jax.random.split(jax.random.key(2), SHAPE.layers)
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(SHAPE.width, SHAPE.width, key=k))(keys)
    layers = eqx_offload.to_host(jax.tree.map(lambda a: a.astype(jnp.bfloat16), layers))

    def step(layers: eqx.nn.Linear, x: jax.Array) -> Any:
        def loss(layers: eqx.nn.Linear) -> jax.Array:
            out = eqx_offload.scan_layers(layers, x, offload_input=True)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.grad(loss)(layers)

    return step, (layers, jnp.ones(SHAPE.width, jnp.bfloat16))


def _streamed(**kwargs: Any) -> Any:
    return functools.partial(eqx_offload.offloaded, **kwargs)


ADAMW = optax.adamw(1e-3)
STEPS: dict[str, Callable[[], Step]] = {
    "plain": lambda: _optax_step(ADAMW),
    "state": lambda: _optax_step(eqx_offload.offloaded(ADAMW)),
    "state-whole": lambda: _optax_step(eqx_offload.offloaded(ADAMW, group_bytes=None)),
    "state-bf16": lambda: _optax_step(eqx_offload.offloaded(ADAMW, host_dtype=jnp.bfloat16)),
    "state-multisteps": lambda: _optax_step(eqx_offload.offloaded(optax.MultiSteps(ADAMW, 2))),
    "activations": lambda: _optax_step(ADAMW, offload_input=True),
    "params-fp32": lambda: _wrapped_step(eqx_offload.host_weights_optimizer(ADAMW), blocks="host"),
    "params-fp32-whole": lambda: _wrapped_step(
        eqx_offload.host_weights_optimizer(ADAMW, offload=_streamed(group_bytes=None)), blocks="host"),
    "params-fp32-host-compute": lambda: _wrapped_step(
        eqx_offload.host_weights_optimizer(ADAMW, offload=_streamed(compute="host")), blocks="host"),
    "params-bf16": lambda: _wrapped_step(eqx_offload.host_weights_optimizer(ADAMW), blocks="host",
                                         dtype=jnp.bfloat16),
    "host-weights-bf16": _host_weights_step,
    "master": lambda: _wrapped_step(eqx_offload.master_weights(ADAMW)),
    "master-params-bf16": lambda: _wrapped_step(eqx_offload.master_weights(ADAMW),
                                                blocks="host"),
    "master-params-activations": lambda: _wrapped_step(
        eqx_offload.master_weights(ADAMW, offload=_streamed(group_bytes=1 << 16)),
        blocks="host", offload_input=True),
    "int8-weights": lambda: _quantised_step(jnp.int8),
    "fp8-weights": lambda: _quantised_step(jnp.float8_e4m3fn),
    "vector-activations-bf16": _vector_inputs_step,
}
# (Models other than the decoder: no plain step to compare with.)
OTHER_MODELS = {"host-weights-bf16", "int8-weights", "fp8-weights", "vector-activations-bf16"}


def compile_for(device: Any, name: str) -> Any:
    """`STEPS[name]` compiled for `device`: its arguments abstract, each leaf's sharding
    on `device` in the memory kind of the array it stands for. Returns XLA:TPU's memory
    analysis."""
    step, args = STEPS[name]()
    mesh = Mesh([device], ("x",))

    def abstract(x: Any) -> Any:
        if not eqx.is_array(x):
            return x
        sharding = NamedSharding(mesh, P(), memory_kind=x.sharding.memory_kind)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    lowered = eqx_offload.filter_jit(step, donate="all").lower_for(
        ("tpu",), jax.tree.map(abstract, args), {})
    return lowered.compile().memory_analysis()


# XLA:TPU stops the process (a failed CHECK) on some programs it cannot compile, e.g. a
# one-row copy into a bf16 host buffer: the steps compile in a child process, which
# reports each step as it finishes; after an abort the next child goes on with the rest.
_FIELDS = ("argument_size_in_bytes", "temp_size_in_bytes", "host_argument_size_in_bytes",
           "host_temp_size_in_bytes")
_START, _DONE = "@@compiling@@", "@@compiled@@"


def compile_each(names: list[str]) -> None:
    """(In the child, with `TPU_ENV` set.) Compile each step for a v5e's first chip and
    print its memory analysis, or its error, one JSON line each."""
    from jax.experimental import topologies

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    for name in names:
        print(_START + name, flush=True)
        try:
            found = compile_for(device, name)
            result: Any = {f: getattr(found, f) for f in _FIELDS}
        except Exception as error:  # reported, and the next step compiles
            result = f"{type(error).__name__}: {error}"[:2000]
        print(_DONE + json.dumps([name, result]), flush=True)


# The child imports the package this process imported (a worktree's, not an installed one).
PACKAGE = str(pathlib.Path(eqx_offload.__file__).resolve().parents[1])


def analyses() -> dict[str, Any]:
    """Every step's memory analysis (a dict of `_FIELDS`) or its failure (a string), by
    name."""
    found: dict[str, Any] = {}
    remaining = list(STEPS)
    while remaining:
        child = run_isolated(compile_each, remaining, env={**TPU_ENV, "PYTHONPATH": PACKAGE})
        started = None
        for line in child.stdout.splitlines():
            if line.startswith(_START):
                started = line[len(_START):]
            elif line.startswith(_DONE):
                name, result = json.loads(line[len(_DONE):])
                found[name], started = result, None
        if started is not None or child.returncode != 0:
            lines = child.stderr.splitlines()
            tail = "\n".join([x for x in lines if "Check failed" in x][:1] or lines[-10:])
            found[started or remaining[0]] = (
                f"the compiler stopped the process (exit {child.returncode}):\n{tail}")
        remaining = [n for n in remaining if n not in found]
    return found


def test_every_mode_compiles_for_a_v5e_and_its_bytes_are_where_the_docs_say(tpu: Any) -> None:
    """Each mode compiles (in one child process, for its first chip: `compile_each`);
    XLA:TPU's memory analysis has its bytes where the docs say."""
    assert {m.kind for m in tpu.addressable_memories()} >= {"device", "pinned_host"}
    found = analyses()
    failed = {name: r for name, r in found.items() if isinstance(r, str)}
    assert not failed, "\n\n".join(f"{name}: {r}" for name, r in failed.items())
    _check_host_bytes(found)
    _check_device_bytes_fall(found)


def _check_host_bytes(found: dict[str, Any]) -> None:
    """What each mode keeps in host memory is there (host bytes of the arguments, or of
    the temporaries for the layer inputs), and the device holds fewer argument bytes
    than the plain step of the same decoder."""
    plain = found["plain"]["argument_size_in_bytes"]
    for name, m in found.items():
        if name == "plain":
            continue
        if name == "activations":
            assert m["host_temp_size_in_bytes"] > 0, name
            continue
        assert m["host_argument_size_in_bytes"] > 0, name
        assert name in OTHER_MODELS or m["argument_size_in_bytes"] < plain, name


def _check_device_bytes_fall(found: dict[str, Any]) -> None:
    """The streamed update needs fewer temporaries than the whole state at once;
    `host_dtype=bfloat16` halves the state's host bytes (to a tile's padding); weights
    in host memory leave the device fewer argument bytes than the state alone, bf16
    weights fewer than fp32; master weights with compute weights in host memory fewer
    than with them on the device."""
    def m(name: str, field: str = "argument_size_in_bytes") -> int:
        value: int = found[name][field]
        return value

    assert m("state", "temp_size_in_bytes") < m("state-whole", "temp_size_in_bytes")
    half, whole = m("state-bf16", "host_argument_size_in_bytes"), m(
        "state", "host_argument_size_in_bytes")
    assert abs(2 * half - whole) < whole / 100  # (a small leaf's tiles are padded)
    assert m("state-bf16") == m("state")
    assert m("params-fp32") < m("state")
    assert m("params-bf16") < m("params-fp32")
    assert m("master-params-bf16") < m("master") < m("state")

"""The steps of the TPU tier (`test_v5e.py`, `test_v5e_host_bytes.py`): every documented
offload mode on a small Llama-style decoder (bench/llama.py: RMSNorm, rotary attention,
SwiGLU, stacked blocks run by `scan_layers`), and a few other models, each with its
arguments."""

import functools
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_offload


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from llama import Llama, llama_loss, LlamaShape  # (bench/: scripts of the repository)


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

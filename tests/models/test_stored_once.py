"""Each parameter stored once: fp32 weights of stacked layers in host memory are the
master weights; each layer comes to the device in fp32 and is cast to bf16 there, in
the layer's call; the master and its 8-bit moments are updated inside the backward
pass (`update_in_backward` over `host_weights_optimizer(..., offload=offloaded(...,
host_dtype=jnp.int8))`). The composition of docs/capacity.md ("Each parameter stored
once"), bitwise its emulation on the CPU, every leaf where it should be."""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import assert_tree_equal

import eqx_offload
from eqx_offload._optim import quantize as q


WIDTH, LAYERS, BATCH = 64, 3, 4
ADAMW = optax.adamw(1e-2, weight_decay=0.1)


def in_bf16(module: Any) -> Any:
    """`module` with its floating arrays cast to bf16 (on the device, where it runs)."""
    return jtu.tree_map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x,
                        module)


class Block(eqx.Module):
    linear: eqx.nn.Linear  # a (64, 64) weight: each layer's moments kept 8-bit

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.linear(x))


class Model(eqx.Module):
    blocks: Block  # stacked, fp32: in host memory, the master weights
    head: eqx.nn.Linear  # fp32 on the device

    def __call__(self, x: jax.Array) -> jax.Array:
        h = eqx_offload.scan_layers(self.blocks, x.astype(jnp.bfloat16),
                                    lambda layer, h: in_bf16(layer)(h))
        return in_bf16(self.head)(h).astype(jnp.float32)


def make_model() -> Model:
    kb, kh = jax.random.split(jax.random.key(0))
    return Model(eqx.filter_vmap(lambda k: Block(eqx.nn.Linear(WIDTH, WIDTH, key=k)))(
        jax.random.split(kb, LAYERS)), eqx.nn.Linear(WIDTH, 1, key=kh))


def loss(model: Model, x: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - 1) ** 2)


def batch(i: int) -> jax.Array:
    return jax.random.normal(jax.random.key(10 + i), (BATCH, WIDTH))


def _quantised(x: Any) -> bool:
    return eqx.is_array(x) and x.size >= 4096  # (`quantize.MIN_SIZE`)


def emulation() -> tuple[Any, Any]:
    """`(init, step)` of the unwrapped computation, everything on the device: the whole
    gradient, AdamW on the dequantised moments, the new moments of the large leaves
    quantised (mu with the signed map, nu with the unsigned), `apply_updates`."""
    def narrowed(state: Any) -> Any:
        adam = state[0]
        return (adam._replace(
            mu=jtu.tree_map(lambda x: q.quantize(x, True) if _quantised(x) else x, adam.mu),
            nu=jtu.tree_map(lambda x: q.quantize(x, False) if _quantised(x) else x, adam.nu)),
            *state[1:])

    def widen(x: Any, p: Any, signed: bool) -> Any:
        if not _quantised(p):
            return x
        return q.dequantize(x, q.Quantized(np.dtype(np.float32), p.shape, signed))

    def init(model: Model) -> Any:
        return narrowed(ADAMW.init(eqx.filter(model, eqx.is_array)))

    @eqx.filter_jit
    def step(model: Model, state: Any, x: jax.Array) -> Any:
        value, grads = eqx.filter_value_and_grad(loss)(model, x)
        params = eqx.filter(model, eqx.is_array)
        adam = state[0]
        state = (adam._replace(
            mu=jtu.tree_map(lambda m, p: widen(m, p, True), adam.mu, params),
            nu=jtu.tree_map(lambda m, p: widen(m, p, False), adam.nu, params)), *state[1:])
        updates, state = ADAMW.update(grads, state, params)
        return value, eqx.apply_updates(model, updates), narrowed(state)

    return init, step


def test_fp32_master_in_host_memory_with_8_bit_moments_updated_in_backward() -> None:
    """Three steps: the loss, the fp32 weights (the master) and the moments bitwise the
    emulation's; the blocks' fp32 weights and every state leaf in host memory (the
    blocks' weights' moments packed 8-bit, the biases' and the head's fp32), the head
    and the step count on the device; no bf16 copy of any weight is kept."""
    optimizer = eqx_offload.host_weights_optimizer(
        ADAMW, offload=functools.partial(eqx_offload.offloaded, host_dtype=jnp.int8))
    fused = eqx_offload.update_in_backward(optimizer, layers=lambda m: m.blocks)
    model = eqx.tree_at(lambda m: m.blocks, make_model(), replace_fn=eqx_offload.to_host)
    model, state = fused.init(model)
    step = eqx_offload.filter_jit(functools.partial(fused.step, loss), donate="all")
    init, ref_step = emulation()
    ref_model = make_model()
    ref_state = init(ref_model)
    for i in range(3):
        value, model, state = step(model, state, batch(i))
        ref_value, ref_model, ref_state = ref_step(ref_model, ref_state, batch(i))
        assert_tree_equal((value, jax.device_get(model)), (ref_value, jax.device_get(ref_model)))
    for half in (state.layers, state.rest):
        assert isinstance(half, eqx_offload.OffloadedState)
    # The state's two halves, as one tree: the layers' moments from `layers`, the rest's.
    whole = eqx.combine(state.layers, state.rest)
    assert_tree_equal(jax.device_get(whole.inner_state), jax.device_get(ref_state))

    kinds = {jtu.keystr(p): (x.dtype, x.sharding.memory_kind)
             for p, x in jtu.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]}
    host32 = (jnp.dtype(jnp.float32), "pinned_host")
    dev32 = (jnp.dtype(jnp.float32), "device")
    assert kinds == {".blocks.linear.weight": host32, ".blocks.linear.bias": host32,
                     ".head.weight": dev32, ".head.bias": dev32}
    packed = (jnp.dtype(jnp.uint32), "pinned_host")
    for half, on_host in ((state.layers, "blocks"), (state.rest, "head")):
        for path, x in jtu.tree_flatten_with_path(half.inner_state)[0]:
            where = jtu.keystr(path)
            got = (x.dtype, x.sharding.memory_kind)
            if where.endswith(".count"):
                assert got == (jnp.dtype(jnp.int32), "device"), where
            elif ".blocks.linear.weight" in where:  # (3, 64, 64): 8-bit, a layer at a time
                assert got == packed and x.shape == (LAYERS, 68, 16), where
            else:
                assert on_host in where and got == host32, where


@pytest.mark.once  # (a script of the repository, as tests/test_chip_script.py)
def test_the_chips_mode_trains_and_stores_each_parameter_once() -> None:
    """`bench/train.py`'s `+activations-once-int8state[-backward]` at a
    small size: the blocks' fp32 weights in host memory and no bf16 copy of them; the
    update in the backward pass bitwise the normal step; the loss falls."""
    import pathlib
    import sys

    bench = pathlib.Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))
    import harness
    import train

    normal = train.main("+activations-once-int8state", 128, 2, 3, 16, 1)
    fused = train.main("+activations-once-int8state-backward", 128, 2, 3, 16, 1)
    assert fused["losses"] == normal["losses"] and fused["falls"]
    assert fused["stored"]["pinned_host"] == normal["stored"]["pinned_host"]
    shape = harness.llama_shape(128, 2, 16, 1)
    blocks = 2 * shape.block_params
    # fp32 weights (4 bytes) and packed 8-bit moments (about 2) of the blocks, and the
    # embeddings' moments, in host memory; the embeddings' fp32 weights on the device.
    assert fused["stored"]["device"] < 4 * (shape.params - blocks) + 64
    assert 6 * blocks < fused["stored"]["pinned_host"] < 6.3 * blocks + 2.2 * (shape.params - blocks)

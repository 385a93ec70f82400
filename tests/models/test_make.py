"""`filter_make` and `stack_layers`: a model and its state made where each array lives,
bitwise those of the ordinary route (the model made, then `init`), every leaf in the
memory kind the mode says, the stacked leaves written a layer at a time by one program
compiled once."""

import functools
import pathlib
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload
from eqx_offload._models import make
from helpers import assert_tree_equal, count_compiles, memory_kinds


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from llama import Llama, LlamaShape  # (bench/: scripts of the repository)


SHAPE = LlamaShape("tiny", width=64, layers=3, heads=2, kv_heads=1, ffn=128, vocab=96,
                   seq=8, batch=2)
ADAMW = optax.adamw(1e-3)


def _llama(key: jax.Array, blocks_on_host: bool, offload_input: bool = False) -> Llama:
    model = Llama(SHAPE, key, offload_input=offload_input)
    if blocks_on_host:
        model = eqx.tree_at(lambda m: m.blocks, model, replace_fn=eqx_offload.to_host)
    return model


def _master(key: jax.Array) -> Any:  # +activations: bf16 blocks, master and state on host
    mw = eqx_offload.master_weights(ADAMW)
    return mw.init(_llama(key, True, offload_input=True))


def _master_on_device_blocks(key: jax.Array) -> Any:  # +master
    return eqx_offload.master_weights(
        ADAMW, offload=functools.partial(eqx_offload.offloaded, host_dtype=jnp.bfloat16)
    ).init(_llama(key, False))


def _host_weights(key: jax.Array) -> Any:  # fp32 blocks on host, state on host
    model = _llama(key, True)
    return model, eqx_offload.host_weights_optimizer(ADAMW).init(model)


def _state(key: jax.Array) -> Any:  # fp32 weights on the device, state on host
    model = _llama(key, False)
    return model, eqx_offload.offloaded(ADAMW).init(eqx.filter(model, eqx.is_array))


def _state_int8(key: jax.Array) -> Any:  # 8-bit moments: a layer's small leaves stay fp32
    model = _llama(key, False)
    opt = eqx_offload.offloaded(ADAMW, host_dtype=jnp.int8)
    return model, opt.init(eqx.filter(model, eqx.is_array))


def _model_only(key: jax.Array) -> Any:
    return _llama(key, True)


MODES = [_master, _master_on_device_blocks, _host_weights, _state, _state_int8, _model_only]


@pytest.mark.parametrize("start", MODES, ids=lambda f: f.__name__)
def test_filter_make_is_the_ordinary_route_bitwise(start: Any) -> None:
    key = jax.random.key(3)
    made = eqx_offload.filter_make(start, key)
    ordinary = start(key)
    assert_tree_equal(made, ordinary)  # bitwise, leaf by leaf
    assert memory_kinds(made) == memory_kinds(ordinary)
    assert "pinned_host" in memory_kinds(made).values()


def test_each_mode_puts_each_leaf_where_it_says() -> None:
    model, state = eqx_offload.filter_make(_master, jax.random.key(0))
    inner = state.inner_state
    assert model.blocks.mlp.up.weight.dtype == jnp.bfloat16
    assert model.blocks.mlp.up.weight.sharding.memory_kind == "pinned_host"
    assert model.embed.weight.sharding.memory_kind == "device"
    assert inner.master.blocks.mlp.up.weight.dtype == jnp.float32
    assert inner.master.blocks.mlp.up.weight.sharding.memory_kind == "pinned_host"
    assert inner.master.embed.weight.sharding.memory_kind == "pinned_host"
    assert inner.inner_state[0].mu.blocks.mlp.up.weight.sharding.memory_kind == "pinned_host"


def test_stacked_leaves_are_written_a_layer_at_a_time_by_one_program() -> None:
    made = make.route(_master, (jax.random.key(0),), {})
    kinds = [p.kind for p in made.programs]
    assert kinds.count("layers") == 1 and kinds.count("buffers") == 1
    (layers,) = [p for p in made.programs if p.kind == "layers"]
    assert layers.layers == SHAPE.layers
    leaves = made.leaves
    # The 7 stacked matrices in bf16 and, with the 2 fp32 norm scales, their master
    # copies and moments (a bf16 norm scale is made whole: see `route`).
    assert all(leaves[i].shape[0] == SHAPE.layers for i in layers.indices)
    assert len(layers.indices) == 7 + 3 * 9
    with count_compiles("write") as compiles:
        eqx_offload.filter_make(_master, jax.random.key(0))
    assert len(compiles) == 1  # compiled once, run `layers` times


def test_stack_layers_is_filter_vmap_outside_filter_make() -> None:
    keys = jax.random.split(jax.random.key(1), 4)
    make_layer = functools.partial(eqx.nn.Linear, 8, 8)
    got = eqx_offload.stack_layers(lambda k: make_layer(key=k), keys)
    assert_tree_equal(got, eqx.filter_vmap(lambda k: make_layer(key=k))(keys))
    assert got.weight.shape == (4, 8, 8)


def test_a_stack_not_made_by_stack_layers_is_made_whole() -> None:
    def start(key: jax.Array) -> Any:
        blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(
            jax.random.split(key, 4))
        return eqx_offload.to_host(blocks)

    made = make.route(start, (jax.random.key(0),), {})
    assert [p.kind for p in made.programs] == ["whole"]
    assert_tree_equal(eqx_offload.filter_make(start, jax.random.key(0)),
                      start(jax.random.key(0)))


def test_a_leaf_that_changes_shape_otherwise_is_made_whole_or_refused() -> None:
    def start(key: jax.Array) -> Any:
        blocks = eqx_offload.stack_layers(lambda k: jax.random.normal(k, (4,)),
                                          jax.random.split(key, 3))
        return blocks.reshape(-1)  # (12,) whole, (4,) for one layer

    # Up to `group_bytes`, such a leaf (8-bit state's codes of a small stack) is made
    # whole; a larger one is an error.
    assert_tree_equal(eqx_offload.filter_make(start, jax.random.key(0)), start(jax.random.key(0)))
    with pytest.raises(eqx_offload.errors.TreeError, match="stack_layers"):
        eqx_offload.filter_make(start, jax.random.key(0), group_bytes=32)


def test_group_bytes_is_checked() -> None:
    with pytest.raises(eqx_offload.errors.OptionError, match="group_bytes"):
        eqx_offload.filter_make(_model_only, jax.random.key(0), group_bytes=-1)


def test_trains_after_filter_make() -> None:
    mw = eqx_offload.master_weights(ADAMW)
    model, state = eqx_offload.filter_make(_master, jax.random.key(0))
    tokens = jnp.zeros((2, SHAPE.seq + 1), jnp.int32)
    from llama import llama_loss

    @eqx_offload.filter_jit(donate="all")
    def step(model: Any, state: Any) -> Any:
        return mw.update(eqx.filter_grad(llama_loss)(model, tokens), state, model)

    new_model, new_state = step(model, state)
    assert model.blocks.mlp.up.weight.is_deleted()
    assert new_model.blocks.mlp.up.weight.sharding.memory_kind == "pinned_host"
    assert new_state.inner_state.master.blocks.mlp.up.weight.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("mesh", [True, False])
def test_made_arrays_are_what_filter_eval_shape_says_and_a_compiled_step_takes(
        mesh: bool) -> None:
    """Every leaf made with the sharding and memory kind `filter_eval_shape` gives it (a
    key over a one-device mesh: the stacked leaves' buffers too; a key on the default
    device: the host leaves made whole too), so a step compiled ahead of time from the
    abstract model and state takes the made arrays as they are."""
    on = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("_",)),
                                    jax.sharding.PartitionSpec())
    key = jax.device_put(jax.random.key(0), on) if mesh else jax.random.key(0)
    abstract = eqx_offload.checkpoint.filter_eval_shape(_master, key)
    made = eqx_offload.filter_make(_master, key)
    assert [x.sharding for x in jax.tree.leaves(made)] == [
        a.sharding for a in jax.tree.leaves(abstract)]
    assert "pinned_host" in memory_kinds(made).values()
    tokens = jnp.zeros((2, SHAPE.seq + 1), jnp.int32)
    tokens = jax.device_put(tokens, on) if mesh else tokens
    from llama import llama_loss

    @eqx_offload.filter_jit(donate="all")
    def step(model: Any, state: Any) -> Any:
        grads = eqx.filter_grad(llama_loss)(model, tokens)
        return eqx_offload.master_weights(ADAMW).update(grads, state, model)

    compiled = step.lower(*abstract).compile()
    new = compiled(*made)  # (a leaf of another sharding: a `SignatureError`)
    assert [x.sharding for x in jax.tree.leaves(new)] == [
        a.sharding for a in jax.tree.leaves(abstract)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.uint8, jnp.bfloat16])
def test_a_host_buffer_is_made_alone_by_the_hosts_cpu_but_for_bf16(dtype: Any) -> None:
    """Each stacked leaf's host buffer is made by a program of its own: by the host's CPU
    (a host computation), but for a floating type under 32 bits, which the device makes
    and moves: the host's CPU made bf16 zeros through a temporary as large as the leaf
    (bitcast from 16-bit integers too), which a TPU runtime's host allocator kept
    resident (docs/results.md, "One host array made three ways")."""
    host = jax.sharding.make_single_device_sharding(jax.devices()[0], memory_kind="pinned_host")
    x = jax.ShapeDtypeStruct((4, 8), dtype, sharding=host)
    text = make._host_program(x).lower().as_text()
    assert ('_xla_compute_type = "host"' in text) == (dtype != jnp.bfloat16)
    out = make._host_program(x)()
    assert out.sharding.memory_kind == "pinned_host"
    assert_tree_equal(out, jnp.zeros((4, 8), dtype))
    with count_compiles("<lambda>") as compiles:  # (one program for one shape)
        buffers = make._buffers_program([x, x])[0](jnp.int32(0), None)
    assert len(compiles) == 1
    assert [b.sharding.memory_kind for b in buffers] == ["pinned_host"] * 2

"""`plan_startup`: the start-up route of `filter_make` compiled for a TPU v5e without one.
Its device peak is a layer's, not the model's (a model made in one program holds all
of it); its host bytes are the arrays it leaves in host memory plus the runtime's share
(14 GB measured on a v5e host, the default for `"v5e"`)."""

import pathlib
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import tpu_plan_marks

import eqx_offload
from eqx_offload.planner import plan, plan_startup, RUNTIME_HOST_BYTES


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from llama import Llama, LlamaShape  # (bench/: scripts of the repository)


pytestmark = [pytest.mark.both, *tpu_plan_marks()]  # (libtpu pins its JAX: both environments)

SHAPE = LlamaShape("small", width=256, layers=16, heads=2, kv_heads=2, ffn=768, vocab=512,
                   seq=8, batch=1)


def _start(key: jax.Array) -> Any:
    model = Llama(SHAPE, key, offload_input=True)
    model = eqx.tree_at(lambda m: m.blocks, model, replace_fn=eqx_offload.to_host)
    return eqx_offload.master_weights(optax.adamw(1e-3)).init(model)


def _key() -> jax.ShapeDtypeStruct:
    key = jax.random.key(0)
    return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=key.sharding)


def _host_bytes(tree: Any) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
               if x.sharding.memory_kind == "pinned_host")


@pytest.mark.slow  # (XLA:TPU plans of minutes: first, with the other long tests)
def test_the_start_up_holds_a_layer_not_the_model() -> None:
    startup = plan_startup(_start, _key(), target="v5e", host_memory=40 * 10**9)
    whole = plan(_start, _key(), target="v5e")  # the model made by one program
    # One layer of the blocks' stacked leaves: bf16 weights, fp32 master, two moments.
    layer = SHAPE.block_params * (2 + 4 + 4 + 4)
    assert startup.device_peak_bytes < 2 * layer < whole.device_peak_bytes / 3
    kinds = [what.split()[0] for what, _, _ in startup.programs]
    assert kinds.count(f"{SHAPE.layers}") == 1  # the layers' program, planned once
    runs = [n for what, n, _ in startup.programs if what.startswith(f"{SHAPE.layers} layers")]
    assert runs == [SHAPE.layers]
    assert startup.host_array_bytes == _host_bytes(
        eqx_offload.checkpoint.filter_eval_shape(_start, _key()))
    assert startup.runtime_host_bytes == RUNTIME_HOST_BYTES["v5e"] == 14 * 10**9
    assert startup.fits
    assert "start-up" in startup.summary()


@pytest.mark.slow  # (XLA:TPU plans of minutes: first, with the other long tests)
def test_the_runtime_share_counts_against_the_host() -> None:
    peak = plan_startup(_start, _key(), target="v5e", runtime_host_memory=0).host_peak_bytes
    arrays = _host_bytes(eqx_offload.checkpoint.filter_eval_shape(_start, _key()))
    assert arrays <= peak < 1.05 * arrays
    fits = plan_startup(_start, _key(), target="v5e", host_memory=peak,
                        runtime_host_memory=0)
    assert fits.fits and fits.runtime_host_bytes == 0
    short = plan_startup(_start, _key(), target="v5e", host_memory=peak)
    assert not short.fits  # the v5e runtime's 14 GB do not fit beside the arrays


def test_runtime_host_memory_is_checked() -> None:
    with pytest.raises(eqx_offload.errors.OptionError, match="runtime_host_memory"):
        plan_startup(_start, _key(), target="v5e", runtime_host_memory=-1)

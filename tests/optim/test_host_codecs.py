"""The codecs of host state (`_optim/codec`): `host_dtype` chooses one; each describes
the form `init` stores; a codec written outside the package (`RowFloat8` below) goes
through `offloaded(..., host_dtype=codec)` in every mode, bitwise its emulation."""

import functools
from collections.abc import Hashable, Sequence
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import assert_tree_equal

import eqx_offload
from eqx_offload._optim.codec import AbstractCodec, Cast, Identity, specs_of
from eqx_offload._optim.options import normalise
from eqx_offload._optim.quantize import Blockwise8Bit


class RowFloat8(AbstractCodec):
    """A format the package does not have: Adam's moments of at least two dimensions as
    float8 (e4m3) codes scaled per row of the last axis by its largest magnitude, the
    row's float32 scale in four more bytes: `uint8` of shape `(..., n + 4)`."""

    def specs(self, paths: Sequence[Any], leaves: Sequence[Any],
              layers: Optional[int]) -> list[Optional[Hashable]]:
        return [jax.ShapeDtypeStruct(x.shape, x.dtype)
                if {"mu", "nu"} & {getattr(k, "name", None) for k in p} and len(x.shape) >= 2
                else None for p, x in zip(paths, leaves, strict=True)]

    def narrow(self, leaf: Any, spec: Hashable) -> Any:
        if leaf.dtype == jnp.uint8:
            return leaf
        x = leaf.astype(jnp.float32)
        scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), 1e-30) / 448
        codes = jax.lax.bitcast_convert_type((x / scale).astype(jnp.float8_e4m3fn), jnp.uint8)
        scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(*x.shape[:-1], 4)
        return jnp.concatenate([codes, scale_bytes], axis=-1)

    def widen(self, leaf: Any, spec: Hashable) -> Any:
        assert isinstance(spec, jax.ShapeDtypeStruct)
        if leaf.dtype != jnp.uint8:
            return leaf
        codes = jax.lax.bitcast_convert_type(leaf[..., :-4], jnp.float8_e4m3fn)
        scale = jax.lax.bitcast_convert_type(leaf[..., -4:], jnp.float32)
        return (codes.astype(jnp.float32) * scale[..., None]).astype(spec.dtype)

    def computes_in(self, dtype: Any, spec: Hashable) -> Any:
        return spec if dtype == jnp.uint8 else dtype

    def stored(self, spec: Hashable) -> jax.ShapeDtypeStruct:
        assert isinstance(spec, jax.ShapeDtypeStruct)
        return jax.ShapeDtypeStruct((*spec.shape[:-1], spec.shape[-1] + 4), jnp.uint8)


CODECS = [Cast(np.dtype(jnp.bfloat16)), Cast(np.dtype(np.float16)), Blockwise8Bit(), RowFloat8()]
ADAMW = optax.adamw(1e-2, weight_decay=0.1)


def _params() -> dict[str, jax.Array]:
    k = jax.random.split(jax.random.key(0), 3)
    # a stack (4, 64, 64), streamed by rows with small groups; a matrix; a vector
    return {"stack": jax.random.normal(k[0], (4, 64, 64)),
            "w": jax.random.normal(k[1], (96, 64)), "b": jax.random.normal(k[2], (64,))}


def _grads(i: int, params: Any) -> Any:
    return jtu.tree_map(lambda x: jax.random.normal(jax.random.key(100 + i), x.shape) * (i + 1),
                        params)


@pytest.mark.parametrize("given,codec", [
    (None, Identity()), (jnp.bfloat16, Cast(np.dtype(jnp.bfloat16))),
    ("float16", Cast(np.dtype(np.float16))), (jnp.int8, Blockwise8Bit()),
    ("uint8", Blockwise8Bit()), (RowFloat8(), RowFloat8()),
])
def test_host_dtype_chooses_the_codec_once(given: Any, codec: AbstractCodec) -> None:
    options = normalise(True, "pinned_host", None, 1, "device", given)
    assert options.codec == codec and type(options.codec) is type(codec)


def test_a_codec_with_host_compute_is_refused() -> None:
    with pytest.raises(eqx_offload.errors.OptionError, match="nothing to narrow"):
        eqx_offload.offloaded(ADAMW, host_dtype=RowFloat8(), compute="host")


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: type(c).__name__)
def test_init_stores_the_form_each_codec_describes(codec: AbstractCodec) -> None:
    """Each leaf `init` leaves in host memory is the codec's `stored` form of its spec
    (the leaf as `inner.init` makes it where its spec is `None`); some are narrowed."""
    params = _params()
    state = eqx_offload.offloaded(ADAMW, host_dtype=codec).init(params)
    made, treedef = jtu.tree_flatten(jax.eval_shape(ADAMW.init, params))
    specs = specs_of(codec, treedef, made, None)
    stored = jtu.tree_leaves(state.inner_state)
    assert any(s is not None for s in specs)
    for x, made_leaf, spec in zip(stored, made, specs, strict=True):
        want = made_leaf if spec is None else codec.stored(spec)
        assert (x.shape, x.dtype) == (want.shape, want.dtype)
        assert x.sharding.memory_kind == ("device" if x.ndim == 0 else "pinned_host")


def _emulation(codec: AbstractCodec, params: Any) -> Any:
    """The state narrowed by hand around a jitted `ADAMW.update`."""
    made, treedef = jtu.tree_flatten(jax.eval_shape(ADAMW.init, params))
    specs = specs_of(codec, treedef, made, None)

    def coded(f: Any, state: Any) -> Any:
        leaves = jtu.tree_leaves(state)
        return jtu.tree_unflatten(treedef, [x if s is None else f(x, s)
                                            for x, s in zip(leaves, specs, strict=True)])

    @jax.jit
    def update(grads: Any, state: Any, params: Any) -> Any:
        updates, state = ADAMW.update(grads, coded(codec.widen, state), params)
        return updates, coded(codec.narrow, state)

    return functools.partial(coded, jax.jit(codec.narrow)), update


@pytest.mark.parametrize("group_bytes", [None, "auto", 0, 8192])
def test_a_codec_from_outside_the_package_runs_in_every_mode(group_bytes: Any) -> None:
    """`RowFloat8` through `offloaded`: three jitted updates (whole state, auto,
    streamed by leaves and by rows of the stack) bitwise the emulation; its moments
    `uint8` in host memory."""
    codec = RowFloat8()
    opt = eqx_offload.offloaded(ADAMW, host_dtype=codec, group_bytes=group_bytes)
    params = _params()
    state = opt.init(params)
    narrow, ref_update = _emulation(codec, params)
    ref_state = narrow(ADAMW.init(params))
    assert_tree_equal(jax.device_get(state.inner_state), jax.device_get(ref_state))
    update = eqx_offload.filter_jit(opt.update)
    for i in range(3):
        updates, state = update(_grads(i, params), state, params)
        ref_updates, ref_state = ref_update(_grads(i, params), ref_state, params)
        assert_tree_equal(updates, ref_updates)
        assert_tree_equal(jax.device_get(state.inner_state), jax.device_get(ref_state))
    adam = state.inner_state[0]
    assert {(x.dtype, x.sharding.memory_kind) for x in jtu.tree_leaves((adam.mu, adam.nu))
            if x.ndim >= 2} == {(jnp.dtype(jnp.uint8), "pinned_host")}


@pytest.mark.parametrize("host_dtype", [jnp.int8, RowFloat8()], ids=["int8", "RowFloat8"])
def test_master_weights_are_never_narrowed_whatever_their_names(host_dtype: Any) -> None:
    """A model whose fields are named as moments (`mu`, `nu`): under `master_weights`
    its fp32 master weights are kept as they are; only Adam's moments are narrowed."""
    class Gaussian(eqx.Module):
        mu: eqx.nn.Linear
        nu: eqx.nn.Linear

    k1, k2 = jax.random.split(jax.random.key(0))
    model = Gaussian(eqx.nn.Linear(64, 128, key=k1), eqx.nn.Linear(64, 128, key=k2))
    mw = eqx_offload.master_weights(
        optax.adam(1e-2), offload=functools.partial(eqx_offload.offloaded, host_dtype=host_dtype))
    _, state = mw.init(model)
    assert {x.dtype for x in jtu.tree_leaves(state.inner_state.master)} == {jnp.dtype(jnp.float32)}
    adam = state.inner_state.inner_state[0]
    assert {x.dtype for x in jtu.tree_leaves((adam.mu, adam.nu)) if x.ndim == 2} != {
        jnp.dtype(jnp.float32)}

"""`scan_layers`, bitwise the rematted scan without moves (a no-op on CPU); what moves where
is read from the jaxpr and from the program lowered for CUDA."""

import functools
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import hex_bits as bits, memory_kinds, unchecked, walk_eqns
from helpers import make_layers, scan_loss, SCAN_DEPTH as L, SCAN_WIDTH as D, tanh_layer
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_offload


HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def plain_scan(layers: Any, x: jax.Array, call: Any = tanh_layer) -> jax.Array:
    """The same computation without `scan_layers`: a rematted scan, no moves."""
    dynamic, static = eqx.partition(layers, eqx.is_array)

    def body(x: jax.Array, arrays: Any) -> tuple[jax.Array, None]:
        return jax.checkpoint(lambda x, a: call(eqx.combine(a, static), x))(x, arrays), None

    return jax.lax.scan(body, x, dynamic)[0]


def plain_loss(layers: Any, x: jax.Array) -> jax.Array:
    return jnp.sum(plain_scan(layers, x) ** 2)


PLAIN = jax.jit(jax.value_and_grad(plain_loss))  # one executable for the table's reference


def _scans(jaxpr: Any) -> list[Any]:
    return [e for e in walk_eqns(jaxpr) if e.primitive.name == "scan"]


def _carries_a_device_layer(scan: Any, shape: tuple[int, ...] = (D, D)) -> bool:
    """Whether a scan's body takes and returns one layer's weight in device memory."""
    body = scan.params["jaxpr"].jaxpr
    return all(any(v.aval.shape == shape and v.aval.memory_space == DEVICE for v in vs)
               for vs in (body.invars, body.outvars))


@pytest.mark.parametrize("where, prefetch, offload_input", [
    (True, True, False), (True, True, True), (True, False, False),
    (eqx_offload.pattern("weight"), True, False), (False, True, False)],
    ids=["host", "host-offload_input", "host-no-prefetch", "host-weights", "device"])
def test_scan_layers_is_bitwise_the_plain_scan(where: Any, prefetch: bool,
                                               offload_input: bool) -> None:
    """Bitwise, gradients in each leaf's memory; host leaves prefetched (carried), and
    with `offload_input` the layer inputs wait in host memory."""
    layers = make_layers()
    x = jax.random.normal(jax.random.key(1), (D,))
    placed = eqx_offload.to_host(layers, where=where)
    args = (placed, x, offload_input, prefetch)
    got = jax.jit(jax.value_and_grad(scan_loss), static_argnums=(2, 3))(*args)
    assert bits(got) == bits(PLAIN(layers, x))
    assert memory_kinds(got[1]) == memory_kinds(placed)
    if where is not False:
        scans = _scans(jax.make_jaxpr(jax.grad(scan_loss), static_argnums=(2, 3))(*args))
        assert [_carries_a_device_layer(e) for e in scans] == [prefetch, prefetch]
        residuals = [v.aval.memory_space for v in scans[0].outvars if v.aval.shape == (L, D)]
        assert residuals == [HOST if offload_input else DEVICE]


class _Quantised(eqx.Module):
    """A layer with an integer scale per output (frozen: not differentiated)."""

    linear: eqx.nn.Linear
    scale: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(self.linear(x)) * self.scale.astype(x.dtype)


@pytest.mark.parametrize("prefetch", [True, False])
def test_scan_layers_fetches_packed_vectors_whole_before_the_scan(prefetch: bool) -> None:
    """Host leaves whose layers are vectors of a dtype under 32 bits (a bf16 bias, an
    int8 scale: a TPU cannot copy one row of them out of host memory) come to the
    device whole before the scan, the bf16 matrices one layer at a time; bitwise,
    gradients in host memory."""
    layers = _Quantised(jax.tree.map(lambda a: a.astype(jnp.bfloat16), make_layers()),
                        jnp.arange(L * D, dtype=jnp.int8).reshape(L, D) % 3)
    x = jax.random.normal(jax.random.key(1), (D,), jnp.bfloat16)

    def grad(scan: Any) -> Any:
        return eqx.filter_grad(
            lambda layers: jnp.sum(scan(layers, x, tanh_layer).astype(jnp.float32) ** 2))

    scan = functools.partial(eqx_offload.scan_layers, prefetch=prefetch)
    placed = eqx_offload.to_host(layers)
    got = eqx.filter_jit(grad(scan))(placed)
    assert bits(got) == bits(eqx.filter_jit(grad(plain_scan))(layers))
    assert memory_kinds(got.linear) == {"weight": "pinned_host", "bias": "pinned_host"}
    assert got.scale is None
    scans = _scans(jax.make_jaxpr(grad(scan))(placed))
    for e in scans:
        kinds = {v.aval.shape: v.aval.memory_space for v in e.invars if v.aval.ndim >= 2}
        assert kinds[(L, D, D)] == HOST and kinds[(L, D)] == DEVICE


@pytest.mark.parametrize("options", [dict(offload_input=True),
                                     dict(offload_input=True, prefetch=False),
                                     dict(policy=eqx_offload.remat.offload_dots())],
                         ids=["input", "input-no-prefetch", "dots"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_scan_layers_offloads_activations_but_packed_vectors(options: Any, dtype: Any) -> None:
    """A value the layer scan would keep in host memory (the layer input, a matrix
    product) stays on the device when it is a vector of a dtype under 32 bits (the scan
    would write one packed row per layer into host memory, which a TPU cannot);
    bitwise either way."""
    layers = jax.tree.map(lambda a: a.astype(dtype), make_layers())
    x = jax.random.normal(jax.random.key(1), (D,), dtype)

    def grad(scan: Any) -> Any:
        return jax.grad(lambda layers: jnp.sum(scan(layers, x, tanh_layer).astype(
            jnp.float32) ** 2))

    scan = functools.partial(eqx_offload.scan_layers, **options)
    placed = eqx_offload.to_host(layers)
    assert bits(jax.jit(grad(scan))(placed)) == bits(jax.jit(grad(plain_scan))(layers))
    forward = _scans(jax.make_jaxpr(grad(scan))(placed))[0]
    kinds = {v.aval.memory_space for v in forward.outvars if v.aval.shape == (L, D)}
    assert (HOST in kinds) == (dtype == jnp.float32)


def test_scan_layers_prefetches_the_next_layer_in_both_passes() -> None:
    """Both scans fetch one slice per step; no stacked device copy is kept."""
    forward, backward = _scans(jax.make_jaxpr(jax.grad(scan_loss))(
        eqx_offload.to_host(make_layers()), jnp.ones(D)))
    assert backward.params["reverse"]
    for scan in (forward, backward):
        weights_in = [v.aval for v in scan.invars if v.aval.shape == (L, D, D)]
        assert weights_in and all(a.memory_space == HOST for a in weights_in)
        fetched = [v.aval.shape for e in walk_eqns(scan.params["jaxpr"]) for v in e.outvars
                   if e.primitive.name == "device_put" and DEVICE in e.params["devices"]]
        assert (1, D, D) in fetched
        assert _carries_a_device_layer(scan)
    assert all(v.aval.memory_space == HOST for v in forward.outvars if v.aval.shape == (L, D, D))
    grads_out = [v.aval for v in backward.outvars if v.aval.shape == (L, D, D)]
    assert grads_out and all(a.memory_space == HOST for a in grads_out)


@pytest.mark.parametrize("offload_input", [False, True])
def test_scan_layers_under_vmap_sums_weight_gradients_inside(offload_input: bool) -> None:
    """Per-example `vmap`: one weight-gradient sum in the scan, bitwise."""
    xs, scales = jax.random.normal(jax.random.key(1), (3, D)), jnp.arange(1.0, 4.0)

    def loss(scan: Any, layers: Any, scale: jax.Array, scales: jax.Array) -> jax.Array:
        def one(x: jax.Array, per_example: jax.Array) -> jax.Array:
            return scan(layers, x, lambda layer, h: jnp.tanh(layer(h)) * scale * per_example)
        return jnp.sum(jax.vmap(one)(xs, scales) ** 2)

    grad = jax.grad(loss, argnums=(1, 2, 3))
    on_host = eqx_offload.to_host(make_layers())
    scan = functools.partial(eqx_offload.scan_layers, offload_input=offload_input)
    got = jax.jit(grad, static_argnums=0)(scan, on_host, jnp.float32(0.5), scales)
    want = jax.jit(grad, static_argnums=0)(plain_scan, make_layers(), jnp.float32(0.5), scales)
    assert bits(got) == bits(want)
    assert memory_kinds(got[0]) == {"weight": "pinned_host", "bias": "pinned_host"}
    jaxpr = jax.make_jaxpr(grad, static_argnums=0)(scan, on_host, jnp.float32(0.5), scales)
    host_outputs = [v.aval.shape for e in _scans(jaxpr) for v in e.outvars
                    if v.aval.memory_space == HOST]
    assert (L, D, D) in host_outputs and (L, 3, D, D) not in host_outputs


def test_scan_layers_lowered_for_gpu_places_slices_on_the_device() -> None:
    """Lowered for CUDA, slices go to the device and gradients to host."""
    def lowered(layers: Any) -> str:
        return jax.jit(jax.grad(scan_loss)).trace(layers, jnp.ones(D)).lower(
            lowering_platforms=("cuda",)).as_text()

    text = lowered(eqx_offload.to_host(make_layers()))
    placements = re.findall(r'_xla_buffer_placement = "(\w+)"', text)
    assert placements.count("device") >= 4 and placements.count("pinned_host") >= 2
    assert "_xla_buffer_placement" not in lowered(make_layers())


def test_scan_layers_composes_with_a_policy_and_extra_arguments() -> None:
    """An offloading policy on host layers is bitwise the saving policy on device layers."""
    scale = jnp.float32(0.5)

    def loss(layers: Any, policy: Any) -> jax.Array:
        def call(layer: Any, h: jax.Array) -> jax.Array:
            return jax.ad_checkpoint.checkpoint_name(jnp.tanh(layer(h)), "act") * scale

        return jnp.sum(eqx_offload.scan_layers(layers, jnp.ones(D), call, policy=policy) ** 2)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    assert bits(grad(eqx_offload.to_host(make_layers()), eqx_offload.remat.offload_names("act"))) == bits(
        grad(make_layers(), jax.checkpoint_policies.save_only_these_names("act")))


def test_scan_layers_refuses_bad_options_and_prefetching_an_ensemble() -> None:
    """Non-bool options, and the prefetch of an ensemble (naming the fix); without it, bitwise."""
    with pytest.raises(eqx_offload.errors.OptionError, match="offload_input"):
        unchecked(eqx_offload.scan_layers)(make_layers(), jnp.ones(D), offload_input="yes")
    with pytest.raises(eqx_offload.errors.OptionError, match="prefetch"):
        unchecked(eqx_offload.scan_layers)(make_layers(), jnp.ones(D), prefetch=1)
    ensemble = jax.tree.map(lambda a, b: jnp.stack([a, b]), make_layers(0), make_layers(1))

    def loss(layers: Any, prefetch: bool) -> jax.Array:
        def one(stack: Any, x: jax.Array) -> jax.Array:
            return eqx_offload.scan_layers(stack, x, tanh_layer, prefetch=prefetch)
        return jnp.sum(jax.vmap(one)(layers, jnp.ones((2, D))) ** 2)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    with pytest.raises(eqx_offload.errors.CompositionError, match="prefetch=False"):
        grad(eqx_offload.to_host(ensemble), True)
    got = grad(eqx_offload.to_host(ensemble), False)
    assert bits(got) == bits(grad(ensemble, False))
    assert memory_kinds(got) == {"weight": "pinned_host", "bias": "pinned_host"}


def test_scan_layers_sharded_layers_keep_their_sharding_in_host_memory() -> None:
    """Bitwise the sharded plain scan; gradients keep mesh and sharding."""
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))
    layers = make_layers()
    sharded = eqx.tree_at(lambda m: (m.weight, m.bias), layers, (
        jax.device_put(layers.weight, NamedSharding(mesh, P(None, "model", None))),
        jax.device_put(layers.bias, NamedSharding(mesh, P(None, "model")))))
    on_host = eqx_offload.to_host(sharded)
    x = jax.device_put(jnp.ones(D), NamedSharding(mesh, P()))
    grads = jax.jit(jax.grad(scan_loss))(on_host, x)
    assert bits(grads) == bits(jax.jit(jax.grad(plain_loss))(sharded, x))
    assert memory_kinds(grads) == {"weight": "pinned_host", "bias": "pinned_host"}
    assert grads.weight.sharding.mesh == mesh
    assert grads.weight.sharding.is_equivalent_to(on_host.weight.sharding, 3)


def _sum_of(layers: Any, seed: int = 3) -> Any:
    """A running gradient sum of `layers`: random, of each array leaf's shape and dtype."""
    arrays = eqx.filter(layers, eqx.is_array)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(arrays))))
    return jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape, a.dtype), arrays)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_scan_layers_accumulate_is_bitwise_the_sum_plus_the_gradient(dtype: Any,
                                                                     jit: bool) -> None:
    """Per-example `vmap`, as a model's loss: the gradient returned for the layers is
    bitwise `accumulate + grad`, the sum made in the backward scan, no stacked gradient."""
    layers = jax.tree.map(lambda a: a.astype(dtype), make_layers())
    acc, xs = _sum_of(layers), jax.random.normal(jax.random.key(1), (3, D), dtype)

    def loss(layers: Any, acc: Any, accumulate: bool) -> jax.Array:
        def one(x: jax.Array) -> jax.Array:
            return eqx_offload.scan_layers(layers, x, tanh_layer,
                                           accumulate=acc if accumulate else None)
        return jnp.sum(jax.vmap(one)(xs).astype(jnp.float32) ** 2)

    def fused(layers: Any, acc: Any) -> Any:
        return jax.grad(loss)(layers, acc, True)

    def unfused(layers: Any, acc: Any) -> Any:
        return jax.tree.map(jnp.add, acc, jax.grad(loss)(layers, acc, False))

    wrap = jax.jit if jit else (lambda f: f)
    got, want = wrap(fused)(layers, acc), wrap(unfused)(layers, acc)
    assert bits(got) == bits(want) and bits(got) != bits(acc)
    backward = _scans(jax.make_jaxpr(fused)(layers, acc))[-1]
    assert backward.params["reverse"]
    # In: the weights and the sum (carried); out: the sum alone, no stacked gradient.
    assert [v.aval.shape for v in backward.invars].count((L, D, D)) == 2
    assert [v.aval.shape for v in backward.outvars].count((L, D, D)) == 1


def test_scan_layers_accumulate_refuses_what_it_cannot_sum() -> None:
    """A policy, weights in host memory, a sum of another structure or dtype: named."""
    layers, x = make_layers(), jnp.ones(D)
    acc = _sum_of(layers)
    cases = [
        ({"policy": eqx_offload.remat.offload_names("x")}, layers, acc, "policy=None"),
        ({}, eqx_offload.to_host(layers), acc, "^Sum the gradients of layers in host memory"),
        ({}, layers, eqx_offload.to_host(acc), "on the device"),
        ({}, layers, acc.weight, "structure"),
        ({}, layers, jax.tree.map(lambda a: a.astype(jnp.bfloat16), acc), "dtype"),
    ]
    for options, stack, total, match in cases:
        with pytest.raises(eqx_offload.errors.OptionError, match=match):
            eqx_offload.scan_layers(stack, x, tanh_layer, accumulate=total, **options)
    ensemble = jax.tree.map(lambda a, b: jnp.stack([a, b]), make_layers(0), make_layers(1))

    def loss(layers: Any) -> jax.Array:
        def one(stack: Any, x: jax.Array) -> jax.Array:
            return eqx_offload.scan_layers(stack, x, tanh_layer, accumulate=acc)
        return jnp.sum(jax.vmap(one)(layers, jnp.ones((2, D))) ** 2)

    with pytest.raises(eqx_offload.errors.CompositionError, match="ensemble"):
        jax.grad(loss)(ensemble)


class _Block(eqx.Module):
    """A transformer block as models write it: LayerNorm, masked attention, MLP."""

    ln1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(32), eqx.nn.LayerNorm(32)
        self.attention = eqx.nn.MultiheadAttention(4, 32, key=k1)
        self.mlp = eqx.nn.MLP(32, 32, 128, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = jax.vmap(self.ln1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


@pytest.mark.parametrize("depth", [1, 3])
def test_scan_layers_transformer_blocks_under_vmap_are_bitwise(depth: int) -> None:
    """Stacked transformer blocks in host memory, per-example `vmap`: bitwise the
    rematted scan. One layer has nothing to prefetch; prefetching it anyway made XLA
    inline both one-step loops and fuse them otherwise than the plain scan's."""
    blocks = eqx.filter_vmap(_Block)(jax.random.split(jax.random.key(0), depth))
    mask = jnp.tril(jnp.ones((16, 16), bool))
    xs = jax.random.normal(jax.random.key(1), (4, 16, 32))

    def loss(blocks: Any, scan: Any) -> jax.Array:
        ys = jax.vmap(lambda x: scan(blocks, x, lambda b, h: b(h, mask)))(xs)
        return jnp.mean(jnp.tanh(ys))

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    got = grad(eqx_offload.to_host(blocks), eqx_offload.scan_layers)
    assert bits(got) == bits(grad(blocks, plain_scan))
    assert set(memory_kinds(got).values()) == {"pinned_host"}
    jaxpr = eqx.filter_make_jaxpr(lambda b: eqx.filter_grad(loss)(b, eqx_offload.scan_layers))(
        eqx_offload.to_host(blocks))[0]
    assert any(_carries_a_device_layer(e, (32, 32)) for e in _scans(jaxpr)) == (depth > 1)


def test_scan_layers_on_a_module_that_is_not_stacked_names_filter_vmap() -> None:
    with pytest.raises(eqx_offload.errors.CompositionError) as caught:
        eqx_offload.scan_layers(eqx.nn.MLP(4, 3, 8, 2, key=jax.random.key(0)), jnp.ones(4))
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("Stack the layers first: `eqx.filter_vmap(make_layer)")
    assert ".layers[0].weight has 8, .layers[2].weight has 3" in lines[1]
    assert len(lines) == 3 and lines[2].endswith("#not-a-stack-of-layers.")

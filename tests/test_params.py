"""Parameters in host memory: `scan_layers`, `host_weights`, `with_host_params`,
`apply_updates`.

On the CPU backend every move is a no-op, so each program is compared bitwise with the
same program without the moves; the structure (what is fetched where, what the backward
pass keeps) is read from the jaxpr and from the program lowered for CUDA."""

import functools
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import assert_tree_equal, count_compiles, memory_kinds, walk_eqns
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_offload


L, D = 4, 16



def make_layers(seed: int = 0) -> eqx.nn.Linear:
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(
        jax.random.split(jax.random.key(seed), L))


def tanh_layer(layer: Any, x: jax.Array) -> jax.Array:
    return jnp.tanh(layer(x))


def plain_scan(layers: Any, x: jax.Array) -> jax.Array:
    """The same computation without `scan_layers`: a rematted scan, no moves."""
    dynamic, static = eqx.partition(layers, eqx.is_array)

    def body(x: jax.Array, arrays: Any) -> tuple[jax.Array, None]:
        return jax.checkpoint(lambda x, a: tanh_layer(eqx.combine(a, static), x))(x, arrays), None

    return jax.lax.scan(body, x, dynamic)[0]


def scan_loss(layers: Any, x: jax.Array, offload_input: bool = False) -> jax.Array:
    out = eqx_offload.scan_layers(layers, x, tanh_layer, offload_input=offload_input)
    return jnp.sum(out ** 2)


def plain_loss(layers: Any, x: jax.Array) -> jax.Array:
    return jnp.sum(plain_scan(layers, x) ** 2)


def host_bytes(tree: Any) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jtu.tree_leaves(tree)]


# ------------------------------------------------------------------------ scan_layers

@pytest.mark.parametrize("offload_input", [False, True])
def test_scan_layers_bitwise_and_gradients_in_host_memory(offload_input: bool) -> None:
    layers = make_layers()
    x = jax.random.normal(jax.random.key(1), (D,))
    on_host = eqx_offload.to_host(layers)
    loss, grads = jax.jit(jax.value_and_grad(scan_loss), static_argnums=2)(on_host, x, offload_input)
    want_loss, want_grads = jax.jit(jax.value_and_grad(plain_loss))(layers, x)
    assert host_bytes((loss, grads)) == host_bytes((want_loss, want_grads))
    assert memory_kinds(grads) == {"weight": "pinned_host", "bias": "pinned_host"}
    # Layers on the device: the same values, gradients on the device.
    grads_device = jax.jit(jax.grad(scan_loss), static_argnums=2)(layers, x, offload_input)
    assert_tree_equal(grads_device, want_grads)
    assert set(memory_kinds(grads_device).values()) == {"device"}


def _scans(jaxpr: Any) -> list[Any]:
    return [e for e in walk_eqns(jaxpr) if e.primitive.name == "scan"]


def _carries_a_device_layer(body: Any) -> bool:
    """Whether a scan body takes and returns one layer's weight in device memory."""
    def device_layer(vs: Any) -> bool:
        return any(v.aval.shape == (D, D) and v.aval.memory_space == jax.memory.Space.Device
                   for v in vs)
    return device_layer(body.jaxpr.invars) and device_layer(body.jaxpr.outvars)


def test_scan_layers_prefetches_the_next_layer_in_both_passes() -> None:
    """The forward scan and the backward scan each take the stacked weights from host
    memory and, inside their body, move one layer's slice to the device: the next
    layer's (forward) or the previous one's (backward), carried to the next iteration as
    a device array. No stacked device copy of a weight is kept between the passes (the
    forward scan's outputs, its residuals, hold no `[L, D, D]` device array), and the
    weight gradients leave the backward scan in host memory."""
    on_host = eqx_offload.to_host(make_layers())
    jaxpr = jax.make_jaxpr(jax.grad(scan_loss))(on_host, jnp.ones(D))
    forward, backward = _scans(jaxpr)
    assert backward.params["reverse"]
    for scan in (forward, backward):
        weights_in = [v.aval for v in scan.invars if v.aval.shape == (L, D, D)]
        assert weights_in and all(a.memory_space == jax.memory.Space.Host for a in weights_in)
        body = scan.params["jaxpr"]
        fetches = [e for e in walk_eqns(body) if e.primitive.name == "device_put"
                   and jax.memory.Space.Device in e.params["devices"]]
        assert any(v.aval.shape == (1, D, D) for e in fetches for v in e.outvars)
        # the prefetched layer is a carry: a device weight in and out of every iteration
        assert _carries_a_device_layer(body)
    residuals = [v.aval for v in forward.outvars if v.aval.ndim == 3]
    assert all(a.memory_space == jax.memory.Space.Host for a in residuals if a.shape == (L, D, D))
    grads_out = [v.aval for v in backward.outvars if v.aval.shape == (L, D, D)]
    assert grads_out and all(a.memory_space == jax.memory.Space.Host for a in grads_out)


def test_scan_layers_without_prefetch_fetches_each_layer_in_its_own_iteration() -> None:
    """`prefetch=False` (and any `policy`): the rematted body fetches its own layer; the
    same bits either way."""
    on_host = eqx_offload.to_host(make_layers())
    x = jax.random.normal(jax.random.key(1), (D,))

    def loss(layers: Any, prefetch: bool) -> jax.Array:
        return jnp.sum(eqx_offload.scan_layers(layers, x, tanh_layer, prefetch=prefetch) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss), static_argnums=1)(on_host, False)
    scans = _scans(jaxpr)
    assert len(scans) == 2 and not any(_carries_a_device_layer(e.params["jaxpr"]) for e in scans)
    fetched = jax.jit(jax.value_and_grad(loss), static_argnums=1)(on_host, False)
    prefetched = jax.jit(jax.value_and_grad(loss), static_argnums=1)(on_host, True)
    assert host_bytes(fetched) == host_bytes(prefetched)
    assert memory_kinds(fetched[1]) == memory_kinds(prefetched[1])


def test_scan_layers_prefetches_only_the_host_leaves() -> None:
    """Weights in host memory, biases on the device: only the weights are prefetched
    (carried), the biases are sliced on the device; the same bits, each gradient in its
    leaf's memory."""
    layers = make_layers()
    x = jax.random.normal(jax.random.key(1), (D,))
    mixed = eqx.tree_at(lambda m: m.weight, layers, replace_fn=eqx_offload.to_host)
    got = jax.jit(jax.value_and_grad(scan_loss))(mixed, x)
    want = jax.jit(jax.value_and_grad(plain_loss))(layers, x)
    assert host_bytes(got) == host_bytes(want)
    assert memory_kinds(got[1]) == {"weight": "pinned_host", "bias": "device"}
    jaxpr = jax.make_jaxpr(jax.grad(scan_loss))(mixed, x)
    assert all(_carries_a_device_layer(e.params["jaxpr"]) for e in _scans(jaxpr))


@pytest.mark.parametrize("offload_input", [False, True])
def test_scan_layers_under_vmap_is_bitwise_and_sums_weight_gradients_inside(
    offload_input: bool,
) -> None:
    """The Equinox idiom: the model runs per example under `jax.vmap`. The weight
    gradients are one sum computed inside the backward scan (no per-example weight
    gradients in host memory), a differentiated value `call` closes over gets its
    gradient, and everything is bitwise the plain rematted scan's (the layer inputs
    kept in host memory or not)."""
    layers = make_layers()
    xs = jax.random.normal(jax.random.key(1), (3, D))
    scales = jnp.arange(1.0, 4.0)

    def loss(scan: Any, layers: Any, scale: jax.Array, scales: jax.Array) -> jax.Array:
        def one(x: jax.Array, per_example: jax.Array) -> jax.Array:
            def call(layer: Any, h: jax.Array) -> jax.Array:
                return jnp.tanh(layer(h)) * scale * per_example
            return scan(layers, x, call)
        return jnp.sum(jax.vmap(one)(xs, scales) ** 2)

    def plain(layers: Any, x: jax.Array, call: Any) -> jax.Array:
        dynamic, static = eqx.partition(layers, eqx.is_array)

        def body(h: jax.Array, arrays: Any) -> tuple[jax.Array, None]:
            return jax.checkpoint(lambda h, a: call(eqx.combine(a, static), h))(h, arrays), None

        return jax.lax.scan(body, x, dynamic)[0]

    grad = jax.grad(loss, argnums=(1, 2, 3))
    on_host = eqx_offload.to_host(layers)
    scan = functools.partial(eqx_offload.scan_layers, offload_input=offload_input)
    got = jax.jit(grad, static_argnums=0)(scan, on_host, jnp.float32(0.5), scales)
    want = jax.jit(grad, static_argnums=0)(plain, layers, jnp.float32(0.5), scales)
    assert host_bytes(got) == host_bytes(want)
    assert memory_kinds(got[0]) == {"weight": "pinned_host", "bias": "pinned_host"}
    jaxpr = jax.make_jaxpr(grad, static_argnums=0)(scan, on_host, jnp.float32(0.5), scales)
    host_outputs = [v.aval.shape for e in _scans(jaxpr) for v in e.outvars
                    if v.aval.memory_space == jax.memory.Space.Host]
    assert (L, D, D) in host_outputs and (L, 3, D, D) not in host_outputs


def test_a_host_slice_only_moved_to_the_device_passes_the_host_compute_check() -> None:
    """`filter_jit` lets a `dynamic_slice` of a host array through (the prefetch's
    fetch, which XLA turns into one asynchronous copy) and still refuses computing on
    the slice in host memory."""
    stacked = jax.device_put(jnp.arange(12.0).reshape(4, 3), jax.memory.Space.Host)

    def fetch(a: jax.Array, i: jax.Array) -> jax.Array:
        row = jax.lax.dynamic_slice(a, (i, 0), (1, 3))
        return jax.device_put(row, jax.memory.Space.Device)[0] * 2

    out = eqx_offload.filter_jit(fetch)(stacked, jnp.int32(2))
    assert_tree_equal(out, jnp.arange(6.0, 9.0) * 2)

    def compute(a: jax.Array, i: jax.Array) -> jax.Array:
        return jax.lax.dynamic_slice(a, (i, 0), (1, 3)) * 2

    with pytest.raises(eqx_offload.CompositionError, match="computes on host-resident"):
        eqx_offload.filter_jit(compute)(stacked, jnp.int32(2))


def test_scan_layers_lowered_for_gpu_places_slices_on_the_device() -> None:
    """Lowered for CUDA (no GPU needed), the loops fetch each slice to the device
    (`annotate_device_placement` "device" inside the `while` bodies) and send each
    weight gradient to host."""
    on_host = eqx_offload.to_host(make_layers())
    text = jax.jit(jax.grad(scan_loss)).trace(on_host, jnp.ones(D)).lower(
        lowering_platforms=("cuda",)).as_text()
    placements = re.findall(r'_xla_buffer_placement = "(\w+)"', text)
    # fwd: weight + bias in; bwd: weight + bias in again, their gradients out.
    assert placements.count("device") >= 4
    assert placements.count("pinned_host") >= 2
    # Without host weights nothing is placed.
    plain = jax.jit(jax.grad(scan_loss)).trace(make_layers(), jnp.ones(D)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "_xla_buffer_placement" not in plain


def test_filter_jit_raises_the_copy_limit_for_a_prefetching_step_on_a_gpu() -> None:
    """A `filter_jit` step whose `scan_layers` prefetches host weights is compiled for a
    GPU with the scheduler's copy limit raised (the layer's fetches then run side by
    side under the layer before; see `_compiler_options.default_compiler_options`), and with nothing
    added without host weights, without the prefetch, or for the CPU."""
    from eqx_offload._compiler_options import GPU_PREFETCHED_OPTIONS
    from eqx_offload._jit import _flatten_call

    def defaults(layers: Any, prefetch: bool, platforms: Any = ("cuda",)) -> dict[str, Any]:
        step = eqx_offload.filter_jit(jax.grad(lambda stack, x: jnp.sum(
            eqx_offload.scan_layers(stack, x, tanh_layer, prefetch=prefetch) ** 2)))
        call = _flatten_call((layers, jnp.ones(D)), {}, step._donate)
        with eqx_offload._deviceless.compiling_for(platforms[0]):
            return step._lower_call(call, platforms=platforms)._default_options

    on_host = eqx_offload.to_host(make_layers())
    assert defaults(on_host, True) == GPU_PREFETCHED_OPTIONS
    assert GPU_PREFETCHED_OPTIONS == {"xla_gpu_experimental_parallel_async_compute_limit": 32}
    assert defaults(on_host, False) == {}
    assert defaults(make_layers(), True) == {}
    assert defaults(on_host, True, ("cpu",)) == {}


def test_scan_layers_offload_input_offloads_the_residual_stream() -> None:
    """With `offload_input`, the layer inputs the backward pass needs wait in host
    memory (a `[L, D]` host residual), where without it the forward scan keeps them on
    the device; both compute the same bits."""
    on_host = eqx_offload.to_host(make_layers())
    x = jnp.ones(D)

    def residual_spaces(offload_input: bool) -> list[Any]:
        jaxpr = jax.make_jaxpr(jax.grad(scan_loss), static_argnums=2)(on_host, x, offload_input)
        forward = _scans(jaxpr)[0]
        return [v.aval.memory_space for v in forward.outvars if v.aval.shape == (L, D)]

    assert residual_spaces(True) == [jax.memory.Space.Host]
    assert residual_spaces(False) == [jax.memory.Space.Device]


def test_scan_layers_composes_with_a_policy_and_extra_arguments() -> None:
    layers = make_layers()
    x = jnp.ones(D)
    scale = jnp.float32(0.5)

    def call(layer: Any, h: jax.Array) -> jax.Array:
        return jax.ad_checkpoint.checkpoint_name(jnp.tanh(layer(h)), "act") * scale

    def loss(layers: Any, policy: Any) -> jax.Array:
        return jnp.sum(eqx_offload.scan_layers(layers, x, call, policy=policy) ** 2)

    offloading = jax.jit(jax.grad(loss), static_argnums=1)(
        eqx_offload.to_host(layers), eqx_offload.offload_names("act"))
    saving = jax.jit(jax.grad(loss), static_argnums=1)(
        layers, jax.checkpoint_policies.save_only_these_names("act"))
    assert host_bytes(offloading) == host_bytes(saving)


def test_scan_layers_vmapped_over_an_ensemble_of_host_stacks() -> None:
    """`jax.vmap` over the stacked layers themselves (an ensemble) with weights in host
    memory: the prefetch refuses, naming the fix; `prefetch=False` is bitwise."""
    ensemble = jax.tree.map(lambda a, b: jnp.stack([a, b]), make_layers(0), make_layers(1))
    x = jnp.ones((2, D))

    def loss(layers: Any, prefetch: bool) -> jax.Array:
        def one(layers: Any, x: jax.Array) -> jax.Array:
            return eqx_offload.scan_layers(layers, x, tanh_layer, prefetch=prefetch)
        return jnp.sum(jax.vmap(one)(layers, x) ** 2)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    with pytest.raises(eqx_offload.CompositionError, match="prefetch=False"):
        grad(eqx_offload.to_host(ensemble), True)
    got = grad(eqx_offload.to_host(ensemble), False)
    assert host_bytes(got) == host_bytes(grad(ensemble, False))
    assert memory_kinds(got) == {"weight": "pinned_host", "bias": "pinned_host"}


def test_scan_layers_rejects_a_non_bool_offload_input_or_prefetch() -> None:
    from helpers import unchecked
    with pytest.raises(eqx_offload.OptionError, match="offload_input"):
        unchecked(eqx_offload.scan_layers)(make_layers(), jnp.ones(D), offload_input="yes")
    with pytest.raises(eqx_offload.OptionError, match="prefetch"):
        unchecked(eqx_offload.scan_layers)(make_layers(), jnp.ones(D), prefetch=1)


def test_scan_layers_sharded_layers_keep_their_sharding_in_host_memory() -> None:
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))
    layers = make_layers()
    sharded = eqx.tree_at(lambda m: (m.weight, m.bias), layers, (
        jax.device_put(layers.weight, NamedSharding(mesh, P(None, "model", None))),
        jax.device_put(layers.bias, NamedSharding(mesh, P(None, "model")))))
    on_host = eqx_offload.to_host(sharded)
    x = jax.device_put(jnp.ones(D), NamedSharding(mesh, P()))
    grads = jax.jit(jax.grad(scan_loss))(on_host, x)
    # The same sharded program without the moves.
    want = jax.jit(jax.grad(plain_loss))(sharded, x)
    assert host_bytes(grads) == host_bytes(want)
    assert memory_kinds(grads) == {"weight": "pinned_host", "bias": "pinned_host"}
    assert grads.weight.sharding.mesh == mesh
    assert grads.weight.sharding.is_equivalent_to(on_host.weight.sharding, 3)


# ------------------------------------------------------------------------ host_weights

def make_mlp() -> eqx.nn.MLP:
    return eqx.nn.MLP(D, D, 32, 2, key=jax.random.key(3))


def mlp_loss(model: Any, x: jax.Array) -> jax.Array:
    return jnp.sum(jax.vmap(model)(x) ** 2)


def test_host_weights_bitwise_and_memory_kinds() -> None:
    model = make_mlp()
    x = jax.random.normal(jax.random.key(4), (8, D))
    wrapped = eqx.tree_at(lambda m: m.layers[1], model, replace_fn=eqx_offload.host_weights)
    assert memory_kinds(wrapped.layers[1]) == {"module/weight": "pinned_host",
                                               "module/bias": "pinned_host"}
    # The reference: the same remat around the same layer, its weights on the device.
    reference = eqx.tree_at(lambda m: m.layers[1], model, replace_fn=eqx_offload.HostWeights)
    grad = eqx.filter_jit(eqx.filter_value_and_grad(mlp_loss))
    (loss, grads), (want_loss, want) = grad(wrapped, x), grad(reference, x)
    assert host_bytes((loss, grads)) == host_bytes((want_loss, want))
    kinds = memory_kinds(grads)
    assert kinds["layers/1/module/weight"] == kinds["layers/1/module/bias"] == "pinned_host"
    assert {k: v for k, v in kinds.items() if "/1/" not in k} == {
        "layers/0/weight": "device", "layers/0/bias": "device",
        "layers/2/weight": "device", "layers/2/bias": "device"}
    # ... and the unwrapped model computes the same bits.
    assert host_bytes(grad(model, x)[1].layers[0]) == host_bytes(grads.layers[0])


def test_host_weights_where_selects_and_backward_fetches_again() -> None:
    layer = eqx.nn.Linear(D, D, key=jax.random.key(5))
    wrapped = eqx_offload.host_weights(layer, where=eqx_offload.pattern("weight"))
    assert memory_kinds(wrapped) == {"module/weight": "pinned_host", "module/bias": "device"}
    # Differentiated with respect to the input too, the backward pass needs the weight.
    loss = eqx.filter_grad(lambda mx: jnp.sum(mx[0](mx[1]) ** 2))
    jaxpr = jax.make_jaxpr(loss)((wrapped, jnp.ones(D)))
    fetches = [e for e in walk_eqns(jaxpr) if e.primitive.name == "device_put"
               and jax.memory.Space.Device in e.params["devices"]]
    # once in the forward pass, once in the backward pass's recomputation
    assert len(fetches) == 2
    # Only the input is differentiated: the weight's gradient needs no weight, and the
    # backward pass fetches nothing.
    jaxpr = jax.make_jaxpr(eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2)))(wrapped, jnp.ones(D))
    assert sum(e.primitive.name == "device_put" and jax.memory.Space.Device in e.params["devices"]
               for e in walk_eqns(jaxpr)) == 1


# ------------------------------------------------------------------------ the rest of the step

def test_apply_updates_bitwise_and_keeps_memory_kinds() -> None:
    params = {"a": jnp.arange(4.0), "b": jnp.ones((2, 2)), "c": jnp.zeros(3), "n": 7}
    placed = eqx_offload.to_host(params, where={"a": True, "b": False, "c": True, "n": False})
    updates = {"a": jnp.full(4, 0.1), "b": eqx_offload.to_host(jnp.full((2, 2), 0.3)),
               "c": None, "n": None}
    for run, n in ((lambda f: f, {}), (jax.jit, {"n": "device"})):  # (jit makes `n` an array)
        new = run(eqx_offload.apply_updates)(placed, updates)
        assert memory_kinds(new) == {"a": "pinned_host", "b": "device", "c": "pinned_host", **n}
        want = run(eqx.apply_updates)(params, eqx_offload.to_device(updates))
        assert_tree_equal(eqx_offload.to_device(new), want)


def test_apply_updates_unpinned_host_eagerly() -> None:
    params = eqx_offload.to_host({"w": jnp.ones(3)}, memory_kind="unpinned_host")
    new = eqx_offload.apply_updates(params, {"w": jnp.ones(3)})
    assert memory_kinds(new) == {"w": "unpinned_host"}
    assert np.asarray(new["w"]).tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("group_bytes", [None, 0])
def test_with_host_params_inside_offloaded_is_bitwise(group_bytes: Any) -> None:
    params = {"w": jax.random.normal(jax.random.key(6), (8, 8)), "b": jnp.ones(8)}
    grads = jax.tree.map(lambda p: p * 0.5 - 0.1, params)
    placed = eqx_offload.to_host(params, where={"w": True, "b": False})
    placed_grads = eqx_offload.to_host(grads, where={"w": True, "b": False})
    opt = eqx_offload.offloaded(eqx_offload.with_host_params(optax.adamw(1e-2)),
                                group_bytes=group_bytes)
    plain = optax.adamw(1e-2)
    state, want_state = opt.init(placed), plain.init(params)

    def make_step(opt: Any, apply: Any) -> Any:
        def step(params: Any, grads: Any, state: Any) -> Any:
            updates, state = opt.update(grads, state, params)
            return apply(params, updates), updates, state
        return jax.jit(step)

    step = make_step(opt, eqx_offload.apply_updates)
    want_step = make_step(plain, eqx.apply_updates)
    for _ in range(2):
        placed, updates, state = step(placed, placed_grads, state)
        params, want_updates, want_state = want_step(params, grads, want_state)
        assert memory_kinds(updates) == {"b": "device", "w": "device"}
        assert memory_kinds(placed) == {"b": "device", "w": "pinned_host"}
        assert host_bytes(updates) == host_bytes(want_updates)
        assert host_bytes(placed) == host_bytes(params)
        assert host_bytes(state.inner_state) == host_bytes(want_state)


def fetched_step(opt: Any) -> Any:
    """A step on a model kept whole in host memory, fetched once at the top (no remat):
    what `eqx_offload.filter_jit` accepts today."""

    def step(model: Any, state: Any, x: jax.Array) -> Any:
        grads = eqx.filter_grad(lambda m: mlp_loss(eqx_offload.to_device(m), x))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx_offload.apply_updates(model, updates), state

    return step


def test_host_params_step_through_filter_jit_with_donation() -> None:
    opt = eqx_offload.offloaded(eqx_offload.with_host_params(optax.adamw(1e-2)))
    plain = optax.adamw(1e-2)
    model = make_mlp()
    x = jax.random.normal(jax.random.key(7), (8, D))
    placed = eqx_offload.to_host(model)
    state = opt.init(eqx.filter(placed, eqx.is_array))
    want_state = plain.init(eqx.filter(model, eqx.is_array))
    step = eqx_offload.filter_jit(fetched_step(opt), donate="all")
    want_step = eqx.filter_jit(fetched_step(plain))
    for i in range(3):
        old = placed
        with count_compiles("step") as compiles:
            placed, state = step(placed, state, x)
        assert len(compiles) == (i == 0)
        assert old.layers[0].weight.is_deleted()
        model, want_state = want_step(model, want_state, x)
    assert set(memory_kinds(placed).values()) == {"pinned_host"}
    assert host_bytes(eqx.filter(placed, eqx.is_array)) == host_bytes(eqx.filter(model, eqx.is_array))


def test_scan_layers_step_through_filter_jit() -> None:
    opt = eqx_offload.offloaded(eqx_offload.with_host_params(optax.adam(1e-2)))
    layers = eqx_offload.to_host(make_layers())
    state = opt.init(layers)

    @eqx_offload.filter_jit(donate="all")
    def step(layers: Any, state: Any, x: jax.Array) -> Any:
        grads = jax.grad(scan_loss)(layers, x)
        updates, state = opt.update(grads, state, layers)
        return eqx_offload.apply_updates(layers, updates), state

    layers, state = step(layers, state, jnp.ones(D))
    assert set(memory_kinds(layers).values()) == {"pinned_host"}


def test_host_params_with_the_state_on_the_device_are_bitwise_and_wait_for_gradients() -> None:
    """`with_host_params(adamw)` with its state on the device (no `offloaded`), weights
    of a `scan_layers` stack in host memory, through `filter_jit`: two donated steps are
    bitwise those on the device, one compile, and in the traced step each host weight
    passes through an `optimization_barrier` with its gradient (so that XLA's GPU
    scheduler fetches it for the update after the backward pass, once, for the update
    and `apply_updates` both: `_params._after_gradients`)."""
    opt = eqx_offload.with_host_params(optax.adamw(1e-2))
    plain = optax.adamw(1e-2)
    x = jax.random.normal(jax.random.key(3), (D,))

    def step_of(loss: Any, opt: Any) -> Any:
        def step(layers: Any, state: Any) -> Any:
            grads = jax.grad(loss)(layers, x)
            updates, state = opt.update(grads, state, layers)
            return eqx_offload.apply_updates(layers, updates), state
        return step

    layers = eqx_offload.to_host(make_layers())
    state = opt.init(layers)
    want, want_state = make_layers(), plain.init(make_layers())
    step = eqx_offload.filter_jit(step_of(scan_loss, opt), donate="all")
    want_step = jax.jit(step_of(plain_loss, plain))
    text = step.lower(layers, state).as_text()
    assert text.count("stablehlo.optimization_barrier") == 2, text  # weight, bias
    for i in range(2):
        old = layers
        with count_compiles("step") as compiles:
            layers, state = step(layers, state)
        assert len(compiles) == (i == 0)
        assert old.weight.is_deleted()
        want, want_state = want_step(want, want_state)
    assert set(memory_kinds(layers).values()) == {"pinned_host"}
    assert_tree_equal(layers, eqx_offload.to_host(want))
    assert_tree_equal(state, want_state)
    # Outside `filter_jit` nothing is tied: `jax.jit` traces the step as written.
    plain_text = jax.jit(step_of(scan_loss, opt)).trace(layers, state).lower().as_text()
    assert "optimization_barrier" not in plain_text


def test_restore_lands_weights_in_host_memory(tmp_path: Any) -> None:
    """A checkpoint restored with the host placement as target comes back in host
    memory, ready for `scan_layers`, bitwise."""
    layers = make_layers()
    path = str(tmp_path / "layers.eqx")
    eqx.tree_serialise_leaves(path, layers)
    target = eqx_offload.restore_target(layers, where=True)
    restored = eqx.tree_deserialise_leaves(path, target,
                                           filter_spec=eqx_offload.deserialise_filter_spec)
    assert memory_kinds(restored) == {"weight": "pinned_host", "bias": "pinned_host"}
    assert host_bytes(restored) == host_bytes(layers)
    grads = jax.jit(jax.grad(scan_loss))(restored, jnp.ones(D))
    assert host_bytes(grads) == host_bytes(jax.jit(jax.grad(plain_loss))(layers, jnp.ones(D)))

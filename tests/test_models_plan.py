"""What parameter and activation offload free in XLA's GPU plan (`eqx_offload.gpu_plan`,
an H200 compiled without a GPU): a plan, not a measurement; the CPU backend moves
nothing, so this is where the techniques show."""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_offload
from helpers import gpu_plan_marks


pytestmark = gpu_plan_marks()

L, D, B = 8, 512, 256
WEIGHT_BYTES = L * (D * D + D) * 4




def layers() -> Any:
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(
        jax.random.split(jax.random.key(0), L))


def tanh_layer(layer: Any, x: jax.Array) -> jax.Array:
    return jnp.tanh(jax.vmap(layer)(x))


def grads_step(offload_input: bool = False) -> Any:
    def step(layers: Any, x: jax.Array) -> Any:
        def loss(layers: Any) -> jax.Array:
            return jnp.sum(eqx_offload.scan_layers(layers, x, tanh_layer,
                                                   offload_input=offload_input) ** 2)
        return jax.grad(loss)(layers)
    return step


def test_parameter_offload_frees_what_it_moves() -> None:
    x = jnp.ones((B, D))
    on_device = eqx_offload.gpu_plan(grads_step(), layers(), x)
    on_host = eqx_offload.gpu_plan(grads_step(), eqx_offload.to_host(layers()), x)
    # the weights and their gradients are in host memory ...
    assert on_host.host_bytes >= 2 * WEIGHT_BYTES
    # ... and at least 80% of those bytes leave the device's peak
    freed = on_device.device_peak_bytes - on_host.device_peak_bytes
    assert freed >= 0.8 * 2 * WEIGHT_BYTES, (freed, on_device.summary(), on_host.summary())
    # (XLA fetches each layer's slice with an asynchronous dynamic-slice from host
    # memory inside the loop; test_prefetched_weight_fetches_... counts those.)


def test_activation_offload_frees_what_it_moves() -> None:
    x = jnp.ones((B, D))
    kept = eqx_offload.gpu_plan(grads_step(False), layers(), x)
    offloaded = eqx_offload.gpu_plan(grads_step(True), layers(), x)
    inputs = L * B * D * 4  # every layer's input, for the backward pass
    assert offloaded.host_bytes >= inputs > kept.host_bytes
    freed = kept.device_peak_bytes - offloaded.device_peak_bytes
    assert freed >= 0.8 * inputs, (freed, kept.summary(), offloaded.summary())


def test_master_weights_keep_fp32_off_the_device() -> None:
    model = eqx.nn.MLP(D, D, D, 4, key=jax.random.key(1))
    x = jnp.ones((B, D))

    def plain_step(model: Any, state: Any) -> Any:
        grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    opt = optax.adamw(1e-3)
    plain = eqx_offload.gpu_plan(eqx_offload.filter_jit(plain_step, donate="all"), model,
                                 opt.init(eqx.filter(model, eqx.is_array)))
    # Streamed: with the default `offloaded`, the whole fp32 master and state come to
    # the device at the update, and the peak barely moves (22.9 vs 23.1 MB here).
    mw = eqx_offload.master_weights(
        opt, offload=functools.partial(eqx_offload.offloaded, group_bytes=0))
    compute, state = mw.init(model)
    xb = x.astype(jnp.bfloat16)

    def mixed_step(model: Any, state: Any) -> Any:
        grads = eqx.filter_grad(
            lambda m: jnp.sum(jax.vmap(m)(xb).astype(jnp.float32) ** 2))(model)
        return mw.update(grads, state, model)

    mixed = eqx_offload.gpu_plan(eqx_offload.filter_jit(mixed_step, donate="all"), compute, state)
    fp32 = sum(x.size * 4 for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    # master weights and both moments wait in host memory
    assert mixed.host_bytes >= 3 * fp32
    # on the device: at most what the plain step holds less the fp32 master and moments
    assert mixed.device_peak_bytes <= plain.device_peak_bytes - 2 * fp32, (
        plain.summary(), mixed.summary())


class MLPBlock(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jnp.tanh(self.up(x)))


def mlp_blocks(n: int, d: int) -> Any:
    return eqx.filter_vmap(lambda k: MLPBlock(
        eqx.nn.Linear(d, 4 * d, key=k), eqx.nn.Linear(4 * d, d, key=jax.random.fold_in(k, 1))))(
        jax.random.split(jax.random.key(0), n))


def test_prefetched_parameters_free_what_they_move_in_a_training_step() -> None:
    """A whole AdamW step (`with_host_params`, its state on the device, `apply_updates`)
    of stacked blocks run by `scan_layers` with their weights in host memory, against
    the same rematted step on the device: at least 80% of the bytes moved to host
    memory leave the device's peak, at least 90% of the layer fetches have kernels
    under them, and the update fetches each weight (and its gradient) once. The
    smallest stack that shows it: before each weight waited for its gradient
    (`_params._after_gradients`), XLA's scheduler started the update's copy of one
    stacked weight before the forward pass, and this step freed 75%."""
    n, d, b = 8, 256, 4096
    opt = eqx_offload.with_host_params(optax.adamw(1e-3))

    @eqx_offload.filter_jit(donate="all")
    def step(layers: Any, state: Any, x: jax.Array) -> Any:
        def loss(layers: Any) -> jax.Array:
            return jnp.sum(jax.vmap(lambda x: eqx_offload.scan_layers(layers, x))(x) ** 2)
        grads = jax.grad(loss)(layers)
        updates, state = opt.update(grads, state, layers)
        return eqx_offload.apply_updates(layers, updates), state

    x = jnp.ones((b, d))
    on_device, on_host = mlp_blocks(n, d), eqx_offload.to_host(mlp_blocks(n, d))
    remat = eqx_offload.gpu_plan(step, on_device, opt.init(on_device), x)
    host = eqx_offload.gpu_plan(step, on_host, opt.init(on_host), x)
    freed = remat.device_peak_bytes - host.device_peak_bytes
    assert freed >= 0.8 * host.host_bytes, (freed, remat.summary(), host.summary())
    fetches = [c for c in host.copies_to("to_device") if c.name.startswith("dynamic-slice-start")]
    assert len(fetches) >= 2 * 4  # a block's 4 leaves, both passes
    assert sum(c.overlapped for c in fetches) >= 0.9 * len(fetches), fetches
    whole = [c for c in host.copies_to("to_device") if c not in fetches]
    assert len(whole) == 2 * 4, whole  # the update: each weight and its gradient, once


def test_prefetched_weight_fetches_overlap_the_previous_layers_compute() -> None:
    """`scan_layers` fetches layer `i + 1`'s weights while layer `i` computes (and layer
    `i - 1`'s in the backward pass). With room in XLA's scheduler for a layer's fetches
    at once (`xla_gpu_experimental_parallel_async_compute_limit`), every fetch in the
    plan has kernels between its start and its end, most of them the layer's, at the
    cost of one layer of weights on the device; fetched at the top of their own
    iteration they span only what runs before the layer first uses them."""
    n, d, b = 4, 256, 128

    def step_for(prefetch: bool) -> Any:
        def step(layers: Any, x: jax.Array) -> Any:
            def loss(layers: Any) -> jax.Array:
                return jnp.sum(jax.vmap(
                    lambda x: eqx_offload.scan_layers(layers, x, prefetch=prefetch))(x) ** 2)
            return jax.grad(loss)(layers)
        return step

    x = jnp.ones((b, d))
    options = {"xla_gpu_experimental_parallel_async_compute_limit": 32}
    on_host = eqx_offload.to_host(mlp_blocks(n, d))
    prefetched = eqx_offload.gpu_plan(step_for(True), on_host, x, compiler_options=options)
    fetched = eqx_offload.gpu_plan(step_for(False), on_host, x, compiler_options=options)
    # every to-device copy of these steps is a fetch of one layer's weights
    fetches = prefetched.copies_to("to_device")
    assert len(fetches) >= 4 * 2  # 4 leaves, both passes
    assert prefetched.overlapped_fraction("to_device") >= 0.9, fetches
    # ... and the layer's kernels run under it: the median prefetched fetch spans at
    # least as many kernels as any fetched at the top of its own iteration (which has
    # only what precedes the layer's first use of its weights)
    under = sorted(c.kernels for c in fetches)
    at_top = max(c.kernels for c in fetched.copies_to("to_device"))
    assert under[len(under) // 2] > at_top, (under, fetched.copies)
    layer_bytes = (2 * 4 * d * d + 4 * d + d) * 4
    extra = prefetched.device_peak_bytes - fetched.device_peak_bytes
    assert extra <= 1.1 * layer_bytes, (extra, layer_bytes)


def test_master_weights_of_host_layers_stream_a_layer_at_a_time() -> None:
    """bf16 stacked blocks in host memory (`scan_layers`), their fp32 master weights and
    AdamW state in host memory too (`master_weights(with_host_params(adamw))`, the
    update streamed): the update brings each layer's rows of master weights, moments
    and gradients to the device and sends that layer's new bf16 weights straight back
    into host memory, so the device never holds a whole stacked leaf. (Before, the
    fetch of the master weights inside `with_host_params` kept each stacked unit whole,
    and the new bf16 weights were concatenated on the device: in the plan of a 2B
    Llama-style step, 19.7 GiB at the peak instead of 3.9.)"""
    n, d, b = 16, 512, 64
    mw = eqx_offload.master_weights(
        eqx_offload.with_host_params(optax.adamw(1e-3)),
        offload=functools.partial(eqx_offload.offloaded, group_bytes=0))
    model, state = mw.init(eqx_offload.to_host(mlp_blocks(n, d)))
    assert model.up.weight.dtype == jnp.bfloat16
    assert model.up.weight.sharding.memory_kind == "pinned_host"

    @eqx_offload.filter_jit(donate="all")
    def step(model: Any, state: Any, x: jax.Array) -> Any:
        def loss(model: Any) -> jax.Array:
            out = jax.vmap(lambda x: eqx_offload.scan_layers(model, x))(x)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return mw.update(jax.grad(loss)(model), state, model)

    plan = eqx_offload.gpu_plan(step, model, state, jnp.ones((b, d), jnp.bfloat16))
    stacked_fp32 = n * d * 4 * d * 4  # one stacked projection's fp32 master weights
    assert plan.host_bytes >= 3 * 2 * stacked_fp32  # master and moments of both
    assert plan.device_peak_bytes < stacked_fp32, plan.summary()

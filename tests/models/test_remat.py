"""Offloading remat policies and `filter_remat`, bitwise the remat that saves the same values
on the device; where they wait is read from the jaxpr and the CUDA lowering."""

import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import hex_bits as bits, unchecked, walk_eqns
from jax.ad_checkpoint import checkpoint_name, Offloadable, Recompute, Saveable

import eqx_offload
from eqx_offload.remat import offload_names, offload_regex


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        ku, kd = jax.random.split(key)
        self.up = eqx.nn.Linear(8, 32, key=ku)
        self.down = eqx.nn.Linear(32, 8, key=kd)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = checkpoint_name(self.up(x), "block/up")
        a = checkpoint_name(jnp.tanh(h), "block/act")
        return x + checkpoint_name(self.down(a), "block/down")


def grads_of(block: Any, x: jax.Array) -> Any:
    return eqx.filter_jit(eqx.filter_grad(lambda b, x: jnp.sum(jax.vmap(b)(x) ** 2)))(block, x)


def host_residuals(fun: Any, *args: Any) -> list[tuple[int, ...]]:
    """Shapes of the values the forward pass sends to host for the backward pass."""
    jaxpr, _, _ = eqx.filter_make_jaxpr(fun)(*args)
    return [tuple(v.aval.shape) for e in walk_eqns(jaxpr) if e.primitive.name == "device_put"
            and jax.memory.Space.Host in e.params["devices"] for v in e.outvars]


BLOCK = Block(jax.random.key(0))
X = jax.random.normal(jax.random.key(1), (4, 8))


# The backward pass needs tanh's output (1 - a**2), or recomputes it from its input; it needs
# `down`'s output not at all; it reads every chosen value, kept on the device or in host memory.
@pytest.mark.parametrize("policy, saved, offloaded", [
    (offload_names("block/act"), ("block/act",), [(4, 32)]),
    (offload_names("block/up", "block/down"), ("block/up", "block/down"), [(4, 32)]),
    (offload_names("block/up", save=("block/act",)), ("block/up", "block/act"), [(4, 32)]),
    (offload_names("block/down", save=("block/act",)), ("block/down", "block/act"), []),
    (offload_regex(r"block/(up|act)", save=r".*/act"), ("block/up", "block/act"), [(4, 32)]),
])
def test_policy_bitwise_to_saving_on_device(policy: Any, saved: Any, offloaded: Any) -> None:
    """Bitwise the remat that saves the same values on the device; `offloaded` in host memory."""
    offloading = eqx_offload.filter_remat(BLOCK, policy)
    saving = jax.checkpoint_policies.save_only_these_names(*saved)
    keeping = eqx.filter_checkpoint(BLOCK, policy=saving)
    assert bits(grads_of(offloading, X)) == bits(grads_of(keeping, X))
    loss = eqx.filter_grad(lambda b: jnp.sum(jax.vmap(b)(X) ** 2))
    assert host_residuals(loss, offloading) == offloaded
    assert host_residuals(loss, keeping) == []


def test_filter_remat_on_a_module_lowered_for_gpu() -> None:
    """Bitwise gradients; for CUDA, to host after the forward, back before use."""
    offloading = eqx_offload.filter_remat(BLOCK, offload_names("block/act"))
    assert bits(grads_of(offloading, X)) == bits(grads_of(BLOCK, X))
    loss = eqx.filter_grad(lambda b, x: jnp.sum(jax.vmap(b)(x) ** 2))
    dynamic, static = eqx.partition(offloading, eqx.is_array)
    text = jax.jit(lambda d, x: loss(eqx.combine(d, static), x)).trace(dynamic, X).lower(
        lowering_platforms=("cuda",)).as_text()
    assert re.findall(r'_xla_buffer_placement = "(\w+)"', text) == ["pinned_host", "device"]


def test_offload_dots_bitwise_to_saving_the_same_dots() -> None:
    def mlp(w1: jax.Array, w2: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)

    w1, w2 = jnp.ones((8, 16)) * 0.1, jnp.ones((16, 8)) * 0.2
    offloading = eqx_offload.filter_remat(mlp, eqx_offload.remat.offload_dots())
    saveable = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    keeping = eqx.filter_checkpoint(mlp, policy=saveable)
    grad = jax.jit(jax.grad(lambda *a: a[-1](*a[:-1]), argnums=(0, 1)), static_argnums=3)
    assert bits(grad(w1, w2, X, offloading)) == bits(grad(w1, w2, X, keeping))
    # both products (x @ w1 and h @ w2) wait in host memory
    def grads(w1: jax.Array, w2: jax.Array, x: jax.Array) -> Any:  # (a function, not a jax.grad)
        return jax.grad(offloading, argnums=(0, 1))(w1, w2, x)

    assert sorted(host_residuals(grads, w1, w2, X)) == [(4, 8), (4, 16)]


def test_policies_choose_by_full_match_are_values_and_bad_ones_option_errors() -> None:
    """`save` wins; equal policies hit `jax.checkpoint`'s cache (keyed on the policy)."""
    policy = offload_regex(r"block/(up|act)", save=r".*/act")
    name_p = next(e.primitive for e in walk_eqns(jax.make_jaxpr(BLOCK)(X[0]))
                  if e.primitive.name == "name")
    assert policy(name_p, name="block/up") == Offloadable(src="device", dst="pinned_host")
    assert policy(name_p, name="block/act") is Saveable
    assert policy(name_p, name="block/down") is Recompute
    assert policy(name_p, name="xblock/up") is Recompute  # fullmatch
    assert policy(jax.lax.tanh_p) is Recompute
    assert offload_names("a") == offload_names("a")
    assert hash(offload_regex("a.*")) == hash(offload_regex("a.*"))
    with pytest.raises(eqx_offload.errors.OptionError, match="both offloaded and saved"):
        offload_names("a", save=("a",))
    with pytest.raises(eqx_offload.errors.OptionError, match="not a name"):
        unchecked(offload_names)(3)
    with pytest.raises(eqx_offload.errors.OptionError, match="not a valid regular expression"):
        offload_regex("(")
    with pytest.raises(eqx_offload.errors.OptionError, match="a policy is a callable"):
        unchecked(eqx_offload.filter_remat)(BLOCK, "block/act")

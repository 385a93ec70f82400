"""Canary (upstream behaviour, not the library's): how plain `jax.jit` compiles a
training step whose optimizer state is committed (as a host-resident state always is).

The first call has uncommitted params (`in_shardings` UNSPECIFIED) and a committed
state; every output of a program with a committed input (or a memory-kind transfer) is
committed, so the second call sees committed params and compiles again. `offloaded`
cannot avoid this (it happens with a device-committed state and no offload at all);
`eqx_offload.filter_jit` compiles once either way (`tests/test_jit.py`), and
`docs/concepts.md` gives the workaround for plain `jax.jit`: commit the params first.
Measured on JAX 0.10.2 and 0.12.0.1. If this canary fails after a JAX upgrade, update
that section of the docs and this file.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from helpers import count_compiles

import eqx_offload


def _compiles_per_call(opt: optax.GradientTransformation, params_committed: bool,
                       state_on_device: bool = False, steps: int = 5) -> list[int]:
    """Compilations per call of `steps` calls of a `jax.jit`-ted step of a small MLP."""
    params, static = eqx.partition(eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0)), eqx.is_array)
    if params_committed:
        params = jax.device_put(params, jax.devices()[0])
    state = opt.init(params)
    if state_on_device:
        state = jax.device_put(state, jax.devices()[0])
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)  # (outside the counted region)
    assert all(leaf.committed == params_committed for leaf in jtu.tree_leaves(params))

    @jax.jit
    def step(params, state, x):
        loss_fn = lambda p: jnp.sum(jax.vmap(eqx.combine(p, static))(x) ** 2)  # noqa: E731
        grads = jax.grad(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        return eqx.apply_updates(params, updates), state

    per_call = []
    for _ in range(steps):
        with count_compiles() as compiles:
            params, state = step(params, state, x)
        per_call.append(len(compiles))
    return per_call


def test_jax_jit_compiles_twice_with_uncommitted_params():
    offloaded = eqx_offload.offloaded(optax.adamw(1e-2))
    assert _compiles_per_call(offloaded, params_committed=False) == [1, 1, 0, 0, 0], (
        "upstream canary: plain jax.jit no longer compiles twice when uncommitted "
        "params meet a committed state; update docs/concepts.md (the double compile)"
    )


def test_jax_jit_compiles_once_with_committed_params():
    # The documented workaround for plain `jax.jit`: commit the params to the device.
    offloaded = eqx_offload.offloaded(optax.adamw(1e-2))
    assert _compiles_per_call(offloaded, params_committed=True) == [1, 0, 0, 0, 0]


def test_jax_jit_double_compile_is_not_offload_specific():
    # The same double compile without any offload, with a state committed to the
    # device. A `pinned_host` array is always committed, so `offloaded` cannot avoid it.
    assert jax.device_put(jnp.ones(2), jax.memory.Space.Host).committed
    plain = optax.adamw(1e-2)
    assert _compiles_per_call(plain, params_committed=False, state_on_device=True) == [1, 1, 0, 0, 0]

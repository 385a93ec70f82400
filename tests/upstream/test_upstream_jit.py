"""Canaries: what plain JAX does under `jit` that `filter_jit` works around or reads.

- `jax.jit` compiles a step twice when uncommitted params meet a committed state (as a
  host-resident one always is); `docs/concepts.md` says to commit the params.
- `jax.experimental.compute_on`: JAX 0.10 has the context manager and the function form
  `compute_on2`; 0.11 renamed that `compute_on`. `compat.host_compute` picks the function
  form, and `filter_jit` accepts host compute under either.
- An array assembled from shards (as orbax restores) with a `pinned_host` sharding is typed
  as device memory; `filter_jit` retypes such leaves (`_jit/jit.py`'s `_mistyped_host`).

If one fails after an upgrade, update that workaround (and its docs)."""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import count_compiles
from jax.experimental import compute_on as compute_on_module

import eqx_offload
from eqx_offload._core.compat import host_compute


CONTEXT_MANAGER_FORM = jax.__version_info__[:2] < (0, 11)


def _compiles_per_call(opt: optax.GradientTransformation, params_committed: bool,
                       state_on_device: bool, steps: int = 5) -> list[int]:
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


@pytest.mark.parametrize("offload,params_committed,state_on_device,expected", [
    pytest.param(True, False, False, [1, 1, 0, 0, 0], id="twice_with_uncommitted_params"),
    pytest.param(True, True, False, [1, 0, 0, 0, 0], id="once_with_committed_params"),  # the fix
    pytest.param(False, False, True, [1, 1, 0, 0, 0], id="double_compile_not_offload_specific"),
])
def test_jax_jit_compiles_per_call(offload, params_committed, state_on_device, expected):
    assert jax.device_put(jnp.ones(2), jax.memory.Space.Host).committed  # always committed
    opt = eqx_offload.offloaded(optax.adamw(1e-2)) if offload else optax.adamw(1e-2)
    assert _compiles_per_call(opt, params_committed, state_on_device) == expected, (
        "upstream canary: plain jax.jit's compiles per call changed with committed state; "
        "update docs/concepts.md (the double compile)"
    )


def test_the_compute_on_shim_picks_the_function_form():
    assert {"compute_type", "out_memory_spaces"} <= set(inspect.signature(host_compute).parameters)
    if CONTEXT_MANAGER_FORM:
        assert host_compute is compute_on_module.compute_on2
        assert list(inspect.signature(compute_on_module.compute_on).parameters) == ["compute_type"]
    else:
        assert not hasattr(compute_on_module, "compute_on2"), (
            "upstream canary: compute_on2 is back; check which form _compat.host_compute picks")
        assert host_compute is compute_on_module.compute_on


def test_both_compute_on_forms_trace_to_one_primitive():
    # `filter_jit`'s check reads `compute_type` off this primitive's parameters.
    double = host_compute(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(
        lambda x: x * 2
    )
    host = jax.device_put(jnp.arange(3.0), jax.memory.Space.Host)
    (eqn,) = jax.make_jaxpr(double)(host).jaxpr.eqns
    assert eqn.primitive.name == "compute_on"
    assert eqn.params["compute_type"] == "device_host"


def _double_under_context_manager(x: jax.Array) -> jax.Array:
    with compute_on_module.compute_on("device_host"):
        return x * 2


def test_compute_on_context_manager_form():
    host = jax.device_put(jnp.arange(3.0), jax.memory.Space.Host)
    if CONTEXT_MANAGER_FORM:
        # JAX 0.10 marks each equation under it with `ctx.compute_type`; `filter_jit`
        # accepts host compute there.
        out = eqx_offload.filter_jit(_double_under_context_manager)(host)
        assert out.sharding.memory_kind == "pinned_host"
        assert (jax.device_put(out, jax.memory.Space.Device) == jnp.arange(3.0) * 2).all()
    else:
        with pytest.raises(TypeError, match="compute_type"):
            _double_under_context_manager(host)


def test_assembled_host_arrays_are_typed_as_device_memory():
    host = jax.device_put(jnp.arange(6.0).reshape(2, 3), jax.memory.Space.Host)
    assert jax.typeof(host).memory_space == jax.memory.Space.Host
    value = np.asarray(host)
    assembled = jax.make_array_from_callback(value.shape, host.sharding, lambda index: value[index])
    from_shards = jax.make_array_from_single_device_arrays(
        value.shape, host.sharding, [s.data for s in host.addressable_shards]
    )
    for x in (assembled, from_shards):
        assert x.sharding.memory_kind == "pinned_host"
        assert jax.typeof(x).memory_space == jax.memory.Space.Device, (
            "upstream canary: JAX now types an assembled pinned_host array as host "
            "memory; filter_jit's retyping of such leaves may be unnecessary"
        )

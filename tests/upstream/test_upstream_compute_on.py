"""Canary (upstream behaviour, not the library's): the forms of
`jax.experimental.compute_on` that each JAX version offers.

JAX 0.10 has the context manager `with compute_on("device_host"):` and the function form
`compute_on2(f, *, compute_type, out_memory_spaces)`. JAX 0.11 removed the context
manager and renamed `compute_on2` to `compute_on`. `eqx_offload._compat.host_compute`
picks the function form, and `filter_jit` accepts host compute under either form. If
this canary fails after a JAX upgrade, the shim in `eqx_offload/_compat.py` needs a new
branch (and `_jit.py`'s check of `compute_type` may too).
"""

import inspect

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import compute_on as compute_on_module

import eqx_offload
from eqx_offload._compat import host_compute


CONTEXT_MANAGER_FORM = jax.__version_info__[:2] < (0, 11)


def test_the_shim_picks_the_function_form():
    parameters = inspect.signature(host_compute).parameters
    assert {"compute_type", "out_memory_spaces"} <= set(parameters)
    if CONTEXT_MANAGER_FORM:
        assert host_compute is compute_on_module.compute_on2
        assert list(inspect.signature(compute_on_module.compute_on).parameters) == ["compute_type"]
    else:
        assert not hasattr(compute_on_module, "compute_on2"), (
            "upstream canary: compute_on2 is back; check which form _compat.host_compute picks")
        assert host_compute is compute_on_module.compute_on


def test_both_forms_trace_to_one_primitive():
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
        y = x * 2
    return y


def test_context_manager_form():
    host = jax.device_put(jnp.arange(3.0), jax.memory.Space.Host)
    if CONTEXT_MANAGER_FORM:
        # JAX 0.10 marks each equation under it with `ctx.compute_type`, and
        # `filter_jit` accepts host compute there.
        out = eqx_offload.filter_jit(_double_under_context_manager)(host)
        assert out.sharding.memory_kind == "pinned_host"
        assert (jax.device_put(out, jax.memory.Space.Device) == jnp.arange(3.0) * 2).all()
    else:
        with pytest.raises(TypeError, match="compute_type"):
            _double_under_context_manager(host)

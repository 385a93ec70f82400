"""Canary: JAX refuses to trace an operation on a host-resident and a device array with a
plain `ValueError` ("memory_space of all inputs passed to `add` must be the same"), which
`compat.memory_space_mismatch` knows by its message (and `compat.mismatched_operands`
reads the operands' types from) so that `filter_jit` can say what to do
(`to_device`). If JAX changes the message or the exception's type, `filter_jit` lets JAX's
error through unexplained: this test fails first."""

import jax
import jax.numpy as jnp
import pytest

from eqx_offload._core.compat import memory_space_mismatch, mismatched_operands


def test_mixed_memory_spaces_are_refused_while_tracing_with_this_message():
    device = jnp.ones((3, 3))
    host = jax.device_put(device, jax.memory.Space.Host)
    with pytest.raises(ValueError) as caught:
        jax.jit(lambda h, d: h + d).trace(host, device)
    assert memory_space_mismatch(caught.value) == "add", str(caught.value)
    assert "float32<host>[3,3]" in str(caught.value)
    # The operands' types, which the error of `filter_jit` names (`lint.memory_space_error`).
    assert mismatched_operands(caught.value) == "float32<host>[3,3] with float32[3,3]", str(
        caught.value)


def test_other_errors_are_not_taken_for_it():
    assert memory_space_mismatch(ValueError("shapes must match")) is None
    assert memory_space_mismatch(TypeError("memory_space of all inputs passed to `add`")) is None

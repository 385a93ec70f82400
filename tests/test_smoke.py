import jax.numpy as jnp
import optax
import pytest

import eqx_offload


pytestmark = pytest.mark.both  # JAX-version dependent: run in the newest environment too


def test_smoke():
    state = eqx_offload.offloaded(optax.adam(1e-3)).init({"w": jnp.ones(3)})
    assert state.inner_state[0].mu["w"].sharding.memory_kind == "pinned_host"
    out = eqx_offload.to_host({"w": jnp.ones(3)}, where=eqx_offload.pattern("w"))
    assert out["w"].sharding.memory_kind == "pinned_host"

"""User mistakes after `isinstance` narrowing of an optimizer state: pytype must not read the
lines after `assert isinstance(state, OffloadedState)` as unreachable (the optax stub's note)."""

import jax
import jax.numpy as jnp
import optax

import eqx_offload

params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
opt = eqx_offload.offloaded(optax.adam(1e-3))
state = opt.init(params)
assert isinstance(state, eqx_offload.OffloadedState)

# A mistake after the assert that has nothing to do with the state.
eqx_offload.to_host(params, memory_kind="gpu")  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# The narrowed state is the wrapper, not the inner optimizer's state.
adam_state: optax.ScaleByAdamState = state  # expect: mypy=assignment pytype=annotation-type-mismatch pyright=reportAssignmentType pyrefly=bad-assignment


def step(grads: dict[str, jax.Array], state: optax.OptState) -> optax.OptState:
    if isinstance(state, eqx_offload.OffloadedState):
        # Inside the narrowed branch: `to_device` takes no memory kind.
        eqx_offload.to_device(state, memory_kind="device")  # expect: mypy=call-arg pytype=wrong-keyword-args pyright=reportCallIssue pyrefly=unexpected-keyword
        # The wrapper's only field is `inner_state`.
        count: int = state  # expect: mypy=assignment pyright=reportAssignmentType pyrefly=bad-assignment
    updates, state = opt.update(grads, state, params)
    return state

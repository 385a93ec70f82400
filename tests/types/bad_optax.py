"""User mistakes with optax transformations and their states."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_offload

model = eqx.nn.Linear(4, 4, key=jax.random.key(0))
params = eqx.filter(model, eqx.is_array)
grads = params

# The optimizer factory itself, not called.
eqx_offload.offloaded(optax.adam)  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# A model where a transformation is expected.
eqx_offload.offloaded(model)  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

opt = eqx_offload.offloaded(optax.adam(1e-3))

# The transformation passed as its own state (instead of `opt.init(params)`).
updates, state = opt.update(grads, opt, params)  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# A transformation is not a number.
learning_rate: int = optax.adam(1e-3)  # expect: mypy=assignment pytype=annotation-type-mismatch pyright=reportAssignmentType pyrefly=bad-assignment

# `compute` is "device" or "host".
eqx_offload.offloaded(optax.adam(1e-3), compute="tpu")  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# `group_bytes` is a number of bytes.
eqx_offload.offloaded(optax.adam(1e-3), group_bytes="1MiB")  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# An `OffloadedState` holds the inner state; it is not the inner state.
inner: optax.ScaleByAdamState = eqx_offload.OffloadedState(optax.adam(1e-3).init(params))  # expect: mypy=assignment pytype=annotation-type-mismatch pyright=reportAssignmentType pyrefly=bad-assignment

"""User mistakes with the start-up and the update inside the backward pass."""

import equinox as eqx
import jax
import optax

import eqx_offload

key = jax.random.key(0)


def make_layer(k: jax.Array) -> eqx.nn.Linear:
    return eqx.nn.Linear(4, 4, key=k)


def start(k: jax.Array) -> dict[str, eqx.nn.Linear]:
    return {"head": eqx.nn.Linear(4, 1, key=k)}


# `group_bytes` is a number of bytes.
eqx_offload.filter_make(start, key, group_bytes="256MiB")  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# `filter_make` returns what the function returns: here a dict, not a layer.
head: eqx.nn.Linear = eqx_offload.filter_make(start, key)  # expect: mypy=assignment pytype=annotation-type-mismatch pyright=reportAssignmentType pyrefly=bad-assignment

# `stack_layers` returns the stacked layer (one module with a layer axis), not a list.
blocks: list[eqx.nn.Linear] = eqx_offload.stack_layers(make_layer, jax.random.split(key, 3))  # expect: mypy=arg-type pytype=annotation-type-mismatch pyright=reportAssignmentType pyrefly=bad-assignment

# `layers` is a function from the model to its stacked layers, not a field name.
eqx_offload.update_in_backward(optax.adam(1e-3), layers="blocks")  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

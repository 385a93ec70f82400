"""User mistakes with `update_in_backward`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_offload


class Model(eqx.Module):
    blocks: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return eqx_offload.scan_layers(self.blocks, x)


def loss(model: Model, x: jax.Array) -> jax.Array:
    return jnp.sum(model(x))


# The optimizer factory itself, not called.
eqx_offload.update_in_backward(optax.adamw, layers=lambda m: m.blocks)  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

fused: eqx_offload.types.BackwardUpdate[Model] = eqx_offload.update_in_backward(
    optax.adamw(1e-3), layers=lambda m: m.blocks, offload=eqx_offload.offloaded)
model, state = fused.init(Model(eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(
    jax.random.split(jax.random.key(0), 2))))

# The model and the loss swapped.
fused.step(model, loss, state, jnp.ones(4))  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# The optimizer's own state where `step` wants the one `init` returned.
fused.step(loss, model, optax.adamw(1e-3).init(model), jnp.ones(4))  # expect: pyright=reportArgumentType pyrefly=bad-argument-type

# The loss value is an array, not a Python number.
value: int = fused.step(loss, model, state, jnp.ones(4))[0]  # expect: mypy=assignment pytype=annotation-type-mismatch pyright=reportAssignmentType pyrefly=bad-assignment

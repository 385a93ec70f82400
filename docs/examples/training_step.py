import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_offload


model = eqx.nn.MLP(8, 1, 32, 2, key=jax.random.key(0))
optimizer = eqx_offload.offloaded(optax.adamw(1e-3))
opt_state = optimizer.init(eqx.filter(model, eqx.is_array))


@eqx_offload.filter_jit(donate="all")
def step(model, opt_state, x, y):
    def loss_fn(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    params = eqx.filter(model, eqx.is_array)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss


x = jax.random.normal(jax.random.key(1), (64, 8))
y = jnp.sum(x, axis=1, keepdims=True)
for _ in range(5):
    model, opt_state, loss = step(model, opt_state, x, y)

# Between steps the moments are in host memory, the step counter on the device.
adam_state = opt_state.inner_state[0]
assert adam_state.mu.layers[0].weight.sharding.memory_kind == "pinned_host"
assert adam_state.count.sharding.memory_kind == "device"
print(eqx_offload.memory_report(opt_state))

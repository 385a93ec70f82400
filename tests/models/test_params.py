"""`host_weights`, `host_weights_optimizer`, `apply_updates`: bitwise the program without moves
(a no-op on CPU); what is fetched where is read from the jaxpr."""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_equal, count_compiles, hex_bits as bits, memory_kinds, unchecked
from helpers import walk_eqns

import eqx_offload


D = 16


def make_mlp() -> eqx.nn.MLP:
    return eqx.nn.MLP(D, D, 32, 2, key=jax.random.key(3))


def mlp_loss(model: Any, x: jax.Array) -> jax.Array:
    return jnp.sum(jax.vmap(model)(x) ** 2)


def _fetches(jaxpr: Any) -> int:
    return sum(e.primitive.name == "device_put" and jax.memory.Space.Device in e.params["devices"]
               for e in walk_eqns(jaxpr))


def test_host_weights_bitwise_memory_kinds_and_fetches() -> None:
    """Weights and gradients of the wrapped layer in host memory, bitwise, fetched when needed."""
    model = make_mlp()
    x = jax.random.normal(jax.random.key(4), (8, D))
    wrapped = eqx.tree_at(lambda m: m.layers[1], model, replace_fn=eqx_offload.host_weights)
    assert set(memory_kinds(wrapped.layers[1]).values()) == {"pinned_host"}
    reference = eqx.tree_at(lambda m: m.layers[1], model, replace_fn=eqx_offload.types.HostWeights)
    grad = eqx.filter_jit(eqx.filter_value_and_grad(mlp_loss))
    got = grad(wrapped, x)
    assert bits(got) == bits(grad(reference, x))
    assert bits(grad(model, x)[1].layers[0]) == bits(got[1].layers[0])
    assert memory_kinds(got[1]) == {
        "layers/0/weight": "device", "layers/0/bias": "device",
        "layers/1/module/weight": "pinned_host", "layers/1/module/bias": "pinned_host",
        "layers/2/weight": "device", "layers/2/bias": "device"}
    # `where` selects; the backward pass fetches the weight again only when it needs it
    wrapped = eqx_offload.host_weights(eqx.nn.Linear(D, D, key=jax.random.key(5)),
                                       where=eqx_offload.pattern("weight"))
    assert memory_kinds(wrapped) == {"module/weight": "pinned_host", "module/bias": "device"}
    both = eqx.filter_grad(lambda mx: jnp.sum(mx[0](mx[1]) ** 2))
    assert _fetches(jax.make_jaxpr(both)((wrapped, jnp.ones(D)))) == 2
    layer_only = eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2))
    assert _fetches(jax.make_jaxpr(layer_only)(wrapped, jnp.ones(D))) == 1


def test_apply_updates_keeps_memory_kinds() -> None:
    """Bitwise `eqx.apply_updates`, each leaf kept in its memory kind."""
    params = {"a": jnp.arange(4.0), "b": jnp.ones((2, 2)), "c": jnp.zeros(3), "n": 7}
    placed = eqx_offload.to_host(params, where={"a": True, "b": False, "c": True, "n": False})
    updates = {"a": jnp.full(4, 0.1), "b": eqx_offload.to_host(jnp.full((2, 2), 0.3)),
               "c": None, "n": None}
    for run, n in ((lambda f: f, {}), (jax.jit, {"n": "device"})):  # (jit makes `n` an array)
        new = run(eqx_offload.apply_updates)(placed, updates)
        assert memory_kinds(new) == {"a": "pinned_host", "b": "device", "c": "pinned_host", **n}
        want = run(eqx.apply_updates)(params, eqx_offload.to_device(updates))
        assert_tree_equal(eqx_offload.to_device(new), want)
    unpinned = eqx_offload.to_host({"w": jnp.ones(3)}, memory_kind="unpinned_host")
    new = eqx_offload.apply_updates(unpinned, {"w": jnp.ones(3)})
    assert memory_kinds(new) == {"w": "unpinned_host"}
    assert np.asarray(new["w"]).tolist() == [2.0] * 3


def _step(opt: Any, apply: Any, loss: Any = None) -> Any:
    """A step from gradients (`loss=None`) or from a batch, updating with `apply`."""
    if loss is None:
        def update(params: Any, grads: Any, state: Any) -> Any:
            updates, state = opt.update(grads, state, params)
            return apply(params, updates), updates, state
        return update

    def step(params: Any, state: Any, x: jax.Array) -> Any:
        grads = eqx.filter_grad(loss)(params, x)
        updates, state = opt.update(grads, state, eqx.filter(params, eqx.is_array))
        return apply(params, updates), state
    return step


def _host_step(hp: Any, loss: Any = None) -> Any:
    """A `host_weights_optimizer` step from gradients (`loss=None`) or from a batch."""
    if loss is None:
        def update(params: Any, grads: Any, state: Any) -> Any:
            return hp.update(grads, state, params)
        return update

    def step(params: Any, state: Any, x: jax.Array) -> Any:
        return hp.update(eqx.filter_grad(loss)(params, x), state, params)
    return step


@pytest.mark.parametrize("options", [dict(group_bytes=None), dict(group_bytes=0),
                                     dict(compute="host")], ids=["whole", "streamed", "host"])
def test_host_weights_optimizer_offloaded_is_bitwise(options: Any) -> None:
    """Host params and gradients, state whole, streamed or updated on the host:
    bitwise, kinds kept."""
    params = {"w": jax.random.normal(jax.random.key(6), (8, 8)), "b": jnp.ones(8)}
    grads = jax.tree.map(lambda p: p * 0.5 - 0.1, params)
    where = {"w": True, "b": False}
    placed, placed_grads = (eqx_offload.to_host(t, where=where) for t in (params, grads))
    hp = eqx_offload.host_weights_optimizer(optax.adamw(1e-2), offload=functools.partial(
        eqx_offload.offloaded, **options))
    plain = optax.adamw(1e-2)
    state, want_state = hp.init(placed), plain.init(params)
    step = jax.jit(_host_step(hp))
    want_step = jax.jit(_step(plain, eqx.apply_updates))
    for _ in range(2):
        placed, state = step(placed, placed_grads, state)
        params, _, want_state = want_step(params, grads, want_state)
        assert memory_kinds(placed) == {"b": "device", "w": "pinned_host"}
        assert bits((placed, state.inner_state)) == bits((params, want_state))


def _barriers(step: Any, *args: Any) -> int:
    return str(step.lower(*args).as_text()).count("stablehlo.optimization_barrier")


@pytest.mark.parametrize("stack, offload", [(False, True), (True, False), (True, True)],
                         ids=["mlp-offloaded", "stack", "stack-offloaded"])
def test_host_weights_optimizer_donated_steps(stack: bool, offload: bool) -> None:
    """Donated steps of a host model, one compile, bitwise; each host weight waits for its
    gradient, under `filter_jit` and `jax.jit` alike, so a GPU fetches it once."""
    hp = eqx_offload.host_weights_optimizer(optax.adamw(1e-2),
                                 offload=eqx_offload.offloaded if offload else None)
    plain = optax.adamw(1e-2)
    if stack:
        model = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(
            jax.random.split(jax.random.key(0), 4))
        x = jax.random.normal(jax.random.key(3), (D,))

        def loss(layers: Any, x: jax.Array) -> jax.Array:
            out = eqx_offload.scan_layers(layers, x, lambda layer, h: jnp.tanh(layer(h)))
            return jnp.sum(out ** 2)
    else:
        model, x = make_mlp(), jax.random.normal(jax.random.key(7), (8, D))
        loss = lambda m, x: mlp_loss(eqx_offload.to_device(m), x)  # noqa: E731
    placed = eqx_offload.to_host(model)
    state = hp.init(placed)
    want_state = plain.init(eqx.filter(model, eqx.is_array))
    step = eqx_offload.filter_jit(_host_step(hp, loss), donate="all")
    jit = jax.jit if stack else eqx.filter_jit
    want_step = jit(_step(plain, eqx_offload.apply_updates, loss))
    n_leaves = len(jax.tree.leaves(eqx.filter(placed, eqx.is_array)))
    assert _barriers(step, placed, state, x) == n_leaves  # (stack: weight, bias)
    if stack:
        assert _barriers(jax.jit(_host_step(hp, loss)), placed, state, x) == n_leaves
    for i in range(2 if stack else 3):
        old = placed
        with count_compiles("step") as compiles:
            placed, state = step(placed, state, x)
        assert len(compiles) == (i == 0)
        assert (old.weight if stack else old.layers[0].weight).is_deleted()
        model, want_state = want_step(model, want_state, x)
    assert set(memory_kinds(placed).values()) == {"pinned_host"}
    assert_tree_equal(placed, eqx_offload.to_host(model))
    assert_tree_equal(state.inner_state if offload else state, want_state)


def test_apply_updates_is_the_same_program_under_any_jit() -> None:
    """`apply_updates` is pure: no wait for gradients, under `filter_jit` as under `jax.jit`."""
    params = eqx_offload.to_host({"w": jnp.ones((4, 4))})
    updates = {"w": jnp.full((4, 4), 0.5)}
    ours = eqx_offload.filter_jit(eqx_offload.apply_updates)
    theirs = jax.jit(eqx_offload.apply_updates)
    assert _barriers(theirs, params, updates) == 0
    assert _barriers(ours, params, updates) == 0
    assert_tree_equal(ours(params, updates), theirs(params, updates))




@pytest.mark.parametrize("kind", ["host_weights_optimizer", "master_weights"])
def test_abstract_init_of_host_weights_and_master_weights_resumes_bitwise(
        kind: str, tmp_path: Any) -> None:
    """`checkpoint.abstract_init(optimizer, model)`: the state's leaves as `init` makes
    them (shape, dtype, memory kind); restoring into it and stepping is bitwise the
    run that never stopped."""
    x = jax.random.normal(jax.random.key(4), (3, D))
    if kind == "master_weights":
        optimizer: Any = eqx_offload.master_weights(optax.adamw(1e-2))
        model, state = optimizer.init(make_mlp())
        model = eqx_offload.to_host(model)
    else:
        optimizer = eqx_offload.host_weights_optimizer(optax.adamw(1e-2))
        model = eqx_offload.to_host(make_mlp())
        state = optimizer.init(model)

    @eqx_offload.filter_jit
    def step(model: Any, state: Any) -> Any:
        def loss(m: Any) -> jax.Array:
            return jnp.sum(jax.vmap(eqx_offload.to_device(m))(x).astype(jnp.float32) ** 2)
        return optimizer.update(eqx.filter_grad(loss)(model), state, model)

    model, state = step(model, state)
    like = eqx_offload.checkpoint.abstract_init(optimizer, model)
    def kinds(tree: Any) -> Any:
        return jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding.memory_kind), tree)
    assert kinds(like) == kinds(state)
    eqx.tree_serialise_leaves(tmp_path / "state.eqx", state)
    restored = eqx_offload.checkpoint.tree_deserialise_leaves(tmp_path / "state.eqx", like)
    assert kinds(restored) == kinds(state)
    assert bits(step(model, restored)) == bits(step(model, state))


@pytest.mark.parametrize("make", [eqx_offload.host_weights_optimizer, eqx_offload.master_weights])
def test_an_optimizer_factory_is_named_with_the_fix(make: Any) -> None:
    """`optax.adamw` itself, not called: the fix first, as `offloaded` says it (it was
    `AttributeError: 'function' object has no attribute 'init'` at `init`)."""
    with pytest.raises(eqx_offload.errors.NotATransformationError,
                       match=r"^If it is an optimizer factory such as `optax.adamw`, call it"):
        unchecked(make)(optax.adamw)

"""Offload on a mesh of CPU devices: sharded models, sharded offloaded state.

`tests/conftest.py` gives the process 8 CPU devices. Every test runs with both mesh axis
types (`jax.make_mesh` defaults to `Explicit` axes in JAX 0.10; `Auto` is the GSPMD
style), for a data-parallel layout (params replicated, batch split) and a data- plus
model-parallel one (Megatron-style: the first weight split by columns, the second by
rows, both 8x8 so that shape alone cannot tell their shardings apart).
"""

from collections.abc import Callable
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import assert_tree_equal, count_compiles, unchecked
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqx_offload


DIM = 8
BATCH = 16
STEPS = 4


class Model(eqx.Module):
    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    b2: jax.Array
    activation: Callable[[jax.Array], jax.Array] = eqx.field(static=True)

    def __call__(self, x: jax.Array, out_sharding: Optional[NamedSharding]) -> jax.Array:
        h = self.activation(x @ self.w1 + self.b1)
        # With explicit axes a contraction over a split dimension must say where its
        # result goes; with auto axes (or one device) the compiler decides.
        return jnp.einsum("bh,ho->bo", h, self.w2, out_sharding=out_sharding) + self.b2


def make_model() -> Model:
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    return Model(
        w1=jax.random.normal(k1, (DIM, DIM)) / 3,
        b1=jax.random.normal(k2, (DIM,)) / 3,
        w2=jax.random.normal(k3, (DIM, DIM)) / 3,
        b2=jax.random.normal(k4, (DIM,)) / 3,
        activation=jnp.tanh,
    )


def batches() -> list[tuple[jax.Array, jax.Array]]:
    keys = jax.random.split(jax.random.key(1), STEPS)
    return [
        (jax.random.normal(k, (BATCH, DIM)), jax.random.normal(jax.random.fold_in(k, 1), (BATCH, DIM)))
        for k in keys
    ]


LAYOUTS = {
    # name: (mesh shape, axis names, param specs, batch spec)
    "data": ((4,), ("data",), {"w1": P(), "b1": P(), "w2": P(), "b2": P()}, P("data", None)),
    "data+model": (
        (2, 4),
        ("data", "model"),
        {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()},
        P("data", None),
    ),
}


def make_mesh(layout: str, axis_type: AxisType) -> jax.sharding.Mesh:
    shape, names, _, _ = LAYOUTS[layout]
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names), devices=jax.devices()[:n])


def shard_model(model: Model, mesh: jax.sharding.Mesh, layout: str) -> Model:
    specs = LAYOUTS[layout][2]
    return eqx.tree_at(
        lambda m: (m.w1, m.b1, m.w2, m.b2),
        model,
        tuple(jax.device_put(getattr(model, k), NamedSharding(mesh, specs[k])) for k in ("w1", "b1", "w2", "b2")),
    )


def make_step(opt: optax.GradientTransformation, jit: Callable[..., Any], out_sharding: Optional[NamedSharding]) -> Callable[..., Any]:
    def loss(model: Model, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((model(x, out_sharding) - y) ** 2)

    @jit
    def step(model: Model, state: Any, x: jax.Array, y: jax.Array) -> tuple[Model, Any, jax.Array]:
        value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, value

    return step


def train(model: Model, opt: optax.GradientTransformation, jit: Callable[..., Any], data: list[Any],
          out_sharding: Optional[NamedSharding] = None, check: Optional[Callable[[Model, Any], None]] = None) -> tuple[Model, Any, list[jax.Array]]:
    step = make_step(opt, jit, out_sharding)
    state = opt.init(eqx.filter(model, eqx.is_array))
    losses = []
    for x, y in data:
        if check is not None:
            check(model, state)
        model, state, value = step(model, state, x, y)
        losses.append(value)
    return model, state, losses


def unsharded_reference() -> tuple[Model, Any, list[jax.Array]]:
    return train(make_model(), optax.adamw(1e-2), eqx.filter_jit, batches())


def param_sharding_of_state_leaf(model: Model, path: tuple[Any, ...]) -> NamedSharding:
    """The sharding of the parameter that the adam moment at `path` mirrors."""
    return getattr(model, path[-1].name).sharding


def check_placement(model: Model, state: eqx_offload.OffloadedState, mesh: jax.sharding.Mesh) -> None:
    """Every moment on host with its parameter's mesh and spec; the counters on the device,
    replicated over the same mesh."""
    adam_state = state.inner_state[0]
    for name in ("mu", "nu"):
        for path, leaf in jtu.tree_flatten_with_path(getattr(adam_state, name))[0]:
            param = param_sharding_of_state_leaf(model, path)
            assert leaf.sharding.memory_kind == "pinned_host", (name, path)
            assert isinstance(leaf.sharding, NamedSharding)
            assert leaf.sharding.mesh == mesh
            assert leaf.sharding.is_equivalent_to(param.with_memory_kind("pinned_host"), leaf.ndim), (
                name, path, leaf.sharding, param)
    assert adam_state.count.sharding.memory_kind == "device"
    assert adam_state.count.sharding.mesh == mesh
    assert adam_state.count.sharding.is_fully_replicated
    for leaf in jtu.tree_leaves(model):
        assert leaf.sharding.memory_kind == "device"
        assert leaf.sharding.mesh == mesh


AXIS_TYPES = pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
LAYOUT = pytest.mark.parametrize("layout", list(LAYOUTS))


@AXIS_TYPES
@LAYOUT
def test_init_keeps_param_sharding(axis_type: AxisType, layout: str) -> None:
    mesh = make_mesh(layout, axis_type)
    model = shard_model(make_model(), mesh, layout)
    state = eqx_offload.offloaded(optax.adamw(1e-2)).init(eqx.filter(model, eqx.is_array))
    check_placement(model, state, mesh)
    # The values equal the unwrapped optimizer's.
    reference = optax.adamw(1e-2).init(eqx.filter(make_model(), eqx.is_array))
    assert_tree_equal(state.inner_state, reference)


@AXIS_TYPES
@LAYOUT
def test_sharded_training_matches_unsharded(axis_type: AxisType, layout: str) -> None:
    mesh = make_mesh(layout, axis_type)
    batch_sharding = NamedSharding(mesh, LAYOUTS[layout][3])
    data = [(jax.device_put(x, batch_sharding), jax.device_put(y, batch_sharding)) for x, y in batches()]
    out_sharding = batch_sharding if axis_type == AxisType.Explicit else None
    jit = eqx_offload.filter_jit(donate="all")

    seen: list[tuple[Model, Any]] = []

    def check(model: Model, state: Any) -> None:
        check_placement(model, state, mesh)
        seen.append((model, state))

    model, state, losses = train(
        shard_model(make_model(), mesh, layout), eqx_offload.offloaded(optax.adamw(1e-2)), jit, data,
        out_sharding, check)
    check_placement(model, state, mesh)
    # Donation: every step consumed the previous model and state.
    for old_model, old_state in seen:
        assert all(leaf.is_deleted() for leaf in jtu.tree_leaves((old_model, old_state)))

    # Against the same sharded program with the unwrapped optimizer: bitwise (offload
    # moves bytes, it does not change arithmetic).
    ref_model, ref_state, ref_losses = train(
        shard_model(make_model(), mesh, layout), optax.adamw(1e-2), eqx.filter_jit, data, out_sharding)
    assert_tree_equal(model, ref_model)
    assert_tree_equal(state.inner_state, ref_state)
    assert_tree_equal(losses, ref_losses)

    # Against one device: the cross-device sums of the gradients may add in another
    # order, so to float tolerance.
    one_model, one_state, one_losses = unsharded_reference()
    for a, b in zip(jtu.tree_leaves((model, state.inner_state, losses)), jtu.tree_leaves((one_model, one_state, one_losses))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


@AXIS_TYPES
def test_one_compilation_for_all_steps(axis_type: AxisType) -> None:
    """The outputs keep the inputs' shardings exactly, so the second step reuses the
    first step's executable (`P()` and `P(None,)` would not hit the same cache entry)."""
    layout = "data+model"
    mesh = make_mesh(layout, axis_type)
    batch_sharding = NamedSharding(mesh, LAYOUTS[layout][3])
    opt = eqx_offload.offloaded(optax.adamw(1e-2))
    step = make_step(opt, eqx_offload.filter_jit(donate="all"), batch_sharding if axis_type == AxisType.Explicit else None)
    model = shard_model(make_model(), mesh, layout)
    state = opt.init(eqx.filter(model, eqx.is_array))
    with count_compiles("step") as compiles:
        for x, y in batches():
            model, state, _ = step(model, state, jax.device_put(x, batch_sharding), jax.device_put(y, batch_sharding))
    assert len(compiles) == 1


def test_same_shape_outputs_keep_their_own_sharding() -> None:
    """Regression: with auto axes every traced value has an all-`None` spec; filter_jit
    used to trust it and replicate every output, and of two inputs of one shape it took
    the first one's sharding for both outputs."""
    mesh = make_mesh("data+model", AxisType.Auto)
    w1 = jax.device_put(jnp.ones((DIM, DIM)), NamedSharding(mesh, P(None, "model")))
    w2 = jax.device_put(jnp.ones((DIM, DIM)), NamedSharding(mesh, P("model", None)))
    host = jax.device_put(jnp.ones((DIM, DIM)), NamedSharding(mesh, P("model", None), memory_kind="pinned_host"))

    @eqx_offload.filter_jit
    def f(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
        on_host = jax.device_put(jax.device_put(tree["c"], jax.memory.Space.Device) * 2, jax.memory.Space.Host)
        return {"a": tree["a"] * 2, "b": tree["b"] * 2, "c": on_host}

    out = f({"a": w1, "b": w2, "c": host})
    assert out["a"].sharding == w1.sharding
    assert out["b"].sharding == w2.sharding
    assert out["c"].sharding == host.sharding


@AXIS_TYPES
def test_uncommitted_batch_with_sharded_model(axis_type: AxisType) -> None:
    """A fresh `jnp` array (uncommitted, on the default device) or a NumPy array next to
    a sharded model goes where `jax.jit` would put it: replicated over the mesh."""
    layout = "data+model"
    mesh = make_mesh(layout, axis_type)
    opt = eqx_offload.offloaded(optax.adamw(1e-2))
    replicated = NamedSharding(mesh, P())
    step = make_step(opt, eqx_offload.filter_jit(donate="all-except-first"),
                     replicated if axis_type == AxisType.Explicit else None)
    model = shard_model(make_model(), mesh, layout)
    state = opt.init(eqx.filter(model, eqx.is_array))
    (x, y), (x2, y2) = batches()[:2]
    assert not x.committed
    model, state, _ = step(model, state, x, y)
    model, state, _ = step(model, state, np.asarray(x2), np.asarray(y2))
    check_placement(model, state, mesh)
    ref_model, _, _ = train(shard_model(make_model(), mesh, layout), optax.adamw(1e-2), eqx.filter_jit,
                            [(jax.device_put(x, replicated), jax.device_put(y, replicated)),
                             (jax.device_put(x2, replicated), jax.device_put(y2, replicated))],
                            replicated if axis_type == AxisType.Explicit else None)
    assert_tree_equal(model, ref_model)


@AXIS_TYPES
def test_to_host_to_device_keep_mesh_and_spec(axis_type: AxisType) -> None:
    mesh = make_mesh("data+model", axis_type)
    model = shard_model(make_model(), mesh, "data+model")
    on_host = eqx_offload.to_host(model)
    back = eqx_offload.to_device(on_host)
    for a, h, b in zip(jtu.tree_leaves(model), jtu.tree_leaves(on_host), jtu.tree_leaves(back)):
        assert h.sharding == a.sharding.with_memory_kind("pinned_host")
        assert b.sharding == a.sharding
        assert np.asarray(b).tobytes() == np.asarray(a).tobytes()


@AXIS_TYPES
@LAYOUT
def test_sharded_update_is_bitwise_one_device(axis_type: AxisType, layout: str) -> None:
    """Where no collective reorders a sum — the optimizer update itself is elementwise —
    the sharded, offloaded update equals the one-device unwrapped update bit for bit."""
    mesh = make_mesh(layout, axis_type)
    # Fresh arrays for each use: `jax.device_put` onto a replicated sharding may reuse a
    # one-device array's buffer for that device's shard, and the sharded run donates.
    params = eqx.filter(make_model(), eqx.is_array)
    grad_list = [jax.tree.map(lambda x, k=k: jnp.sin(x * (k + 2)), params) for k in range(STEPS)]

    opt = eqx_offload.offloaded(optax.adamw(1e-2))

    @eqx_offload.filter_jit(donate="all-except-first")
    def update(grads: Any, state: Any, p: Any) -> Any:
        updates, state = opt.update(grads, state, p)
        return eqx.apply_updates(p, updates), state

    sharded = eqx.filter(shard_model(make_model(), mesh, layout), eqx.is_array)
    state = opt.init(sharded)
    ref_opt = optax.adamw(1e-2)
    ref_params, ref_state = params, ref_opt.init(params)

    @jax.jit
    def ref_update(grads: Any, state: Any, p: Any) -> Any:
        updates, state = ref_opt.update(grads, state, p)
        return eqx.apply_updates(p, updates), state
    for grads in grad_list:
        sharded_grads = jax.tree.map(lambda g, p: jax.device_put(g, p.sharding, may_alias=False), grads, sharded)
        sharded, state = update(sharded_grads, state, sharded)
        ref_params, ref_state = ref_update(grads, ref_state, ref_params)
    check_placement(shard_model(make_model(), mesh, layout), state, mesh)
    assert_tree_equal(state.inner_state, ref_state)
    assert_tree_equal(sharded, ref_params)


# ---------------------------------------------------------------------------------------
# Equinox's data-parallel idiom: `filter_shard` after `init` and inside the step


def _shard_step(opt: optax.GradientTransformation, jit: Callable[..., Any],
                replicated: NamedSharding, data: NamedSharding) -> Callable[..., Any]:
    @jit
    def step(model: Model, state: Any, x: jax.Array, y: jax.Array) -> Any:
        model, state = eqx.filter_shard((model, state), replicated)
        x, y = eqx.filter_shard((x, y), data)
        value, grads = eqx.filter_value_and_grad(
            lambda m: jnp.mean((m(x, None) - y) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return (*eqx.filter_shard((model, state), replicated), value)

    return step


def test_filter_shard_idiom_bitwise_and_state_stays_on_host() -> None:
    """The ported program: `eqx_offload.filter_shard` for the eager placement after
    `init` (JAX commits every host array, and `eqx.filter_shard` outside `jit` cannot
    move a committed array to other devices, nor keep its memory); `eqx.filter_shard`
    inside the step as it is (a placement, not a computation: the state stays on host)."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data", None))

    model = make_model()
    ref_opt = optax.adamw(1e-2)
    ref_state = ref_opt.init(eqx.filter(model, eqx.is_array))
    ref_model, ref_state = eqx.filter_shard((model, ref_state), replicated)
    ref_step = _shard_step(ref_opt, eqx.filter_jit(donate="all"), replicated, data)

    opt = eqx_offload.offloaded(optax.adamw(1e-2))
    state = opt.init(eqx.filter(model, eqx.is_array))
    with pytest.raises(ValueError, match="incompatible devices"):  # upstream, eagerly
        eqx.filter_shard(state, replicated)
    model, state = eqx_offload.filter_shard((model, state), replicated)
    host = [x for x in jax.tree.leaves(state) if x.ndim]
    assert all(x.sharding == replicated.with_memory_kind("pinned_host") for x in host)
    step = _shard_step(opt, eqx_offload.filter_jit(donate="all"), replicated, data)

    for x, y in batches():
        x, y = eqx.filter_shard((x, y), data)
        ref_model, ref_state, ref_value = ref_step(ref_model, ref_state, x, y)
        model, state, value = step(model, state, x, y)
        assert_tree_equal((model, state.inner_state, value), (ref_model, ref_state, ref_value))
        for leaf in jax.tree.leaves(state):
            want = "pinned_host" if leaf.ndim else "device"
            assert leaf.sharding.memory_kind == want and leaf.sharding.mesh == mesh


def test_filter_shard_under_jit_keeps_memory() -> None:
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    replicated = NamedSharding(mesh, P())
    tree = {"host": eqx_offload.to_host(jnp.arange(8.0)), "device": jnp.arange(4.0), "n": 3}
    eager = eqx_offload.filter_shard(tree, replicated)
    # Under `jit` it is a constraint: the arguments must already be on the mesh's devices.
    spread = NamedSharding(mesh, P("data"))
    jitted = eqx_offload.filter_jit(lambda t: eqx_offload.filter_shard(t, spread))(eager)
    assert jitted["host"].sharding.spec == P("data")
    for out in (eager, jitted):
        assert out["host"].sharding.memory_kind == "pinned_host"
        assert out["host"].sharding.mesh == mesh
        assert out["device"].sharding.memory_kind == "device" and out["n"] == 3
        assert_tree_equal(out, tree)
    with pytest.raises(eqx_offload.OptionError, match="must be a `jax.sharding.Sharding`"):
        unchecked(eqx_offload.filter_shard)(tree, P())

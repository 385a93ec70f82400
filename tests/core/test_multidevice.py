"""Sharded models and offloaded state on 8 CPU devices, `Explicit` and `Auto` axes, data- and
data+model-parallel (both weights 8x8, so shape cannot tell them apart); every shard's data
through `to_host`, `filter_shard` and the restores, not replicated."""

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_tree_equal, count_compiles, unchecked
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqx_offload


DIM, BATCH, STEPS = 8, 16, 4
# name: (mesh shape, axis names, param specs)
LAYOUTS = {
    "data": ((4,), ("data",), {"w1": P(), "b1": P(), "w2": P(), "b2": P()}),
    "data+model": ((2, 4), ("data", "model"),
                   {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}),
}
AXIS_TYPES = pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                                     ids=["explicit", "auto"])
LAYOUT = pytest.mark.parametrize("layout", list(LAYOUTS))


class Model(eqx.Module):
    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    b2: jax.Array
    activation: Callable[[jax.Array], jax.Array] = eqx.field(static=True)

    def __call__(self, x: jax.Array, out_sharding: Optional[NamedSharding]) -> jax.Array:
        # With explicit axes a contraction over a split dimension must say where its
        # result goes; with auto axes (or one device) the compiler decides.
        h = self.activation(x @ self.w1 + self.b1)
        return jnp.einsum("bh,ho->bo", h, self.w2, out_sharding=out_sharding) + self.b2


def make_model(mesh: Optional[jax.sharding.Mesh] = None, layout: str = "data") -> Model:
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = {"w1": (DIM, DIM), "b1": (DIM,), "w2": (DIM, DIM), "b2": (DIM,)}
    arrays = {k: jax.random.normal(key, shape) / 3 for key, (k, shape) in zip(keys, shapes.items())}
    if mesh is not None:
        arrays = {k: jax.device_put(v, NamedSharding(mesh, LAYOUTS[layout][2][k]))
                  for k, v in arrays.items()}
    return Model(**arrays, activation=jnp.tanh)


def batches() -> list[tuple[jax.Array, jax.Array]]:
    keys = jax.random.split(jax.random.key(1), STEPS)
    normal = lambda k: jax.random.normal(k, (BATCH, DIM))  # noqa: E731
    return [(normal(k), normal(jax.random.fold_in(k, 1))) for k in keys]


def make_mesh(layout: str, axis_type: AxisType) -> jax.sharding.Mesh:
    shape, names, _ = LAYOUTS[layout]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names),
                         devices=jax.devices()[:int(np.prod(shape))])


def make_step(opt: Any, jit: Callable[..., Any], out_sharding: Optional[NamedSharding]) -> Any:
    @jit
    def step(model: Model, state: Any, x: jax.Array, y: jax.Array) -> tuple[Model, Any, jax.Array]:
        value, grads = eqx.filter_value_and_grad(
            lambda m: jnp.mean((m(x, out_sharding) - y) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, value

    return step


def train(model: Model, opt: Any, jit: Callable[..., Any], data: list[Any],
          out_sharding: Optional[NamedSharding] = None,
          check: Callable[[Model, Any], None] = lambda m, s: None) -> tuple[Model, Any, list[Any]]:
    step = make_step(opt, jit, out_sharding)
    state = opt.init(eqx.filter(model, eqx.is_array))
    losses = []
    for x, y in data:
        check(model, state)
        model, state, value = step(model, state, x, y)
        losses.append(value)
    return model, state, losses


def check_placement(model: Model, state: Any, mesh: jax.sharding.Mesh) -> None:
    """Moments on host with their parameter's sharding; count and model on device."""
    adam = state.inner_state[0]
    for moments in (adam.mu, adam.nu):
        for path, leaf in jtu.tree_flatten_with_path(moments)[0]:
            param = getattr(model, path[-1].name).sharding.with_memory_kind("pinned_host")
            assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh
            assert leaf.sharding.memory_kind == "pinned_host"
            assert leaf.sharding.is_equivalent_to(param, leaf.ndim), (path, leaf.sharding, param)
    count = adam.count.sharding
    assert count.memory_kind == "device" and count.mesh == mesh and count.is_fully_replicated
    assert all(x.sharding.memory_kind == "device" and x.sharding.mesh == mesh
               for x in jtu.tree_leaves(model))


@AXIS_TYPES
@LAYOUT
def test_sharded_training_matches_unsharded(axis_type: AxisType, layout: str) -> None:
    """Placements kept, donated, one compile, bitwise the unwrapped sharded run, and one device
    to float tolerance (cross-device sums may add in another order); the elementwise update
    alone, sharded and offloaded, is bitwise one device's."""
    mesh = make_mesh(layout, axis_type)
    model = make_model(mesh, layout)
    on_host = eqx_offload.to_host(model)
    for a, h, b in zip(jtu.tree_leaves(model), jtu.tree_leaves(on_host),
                       jtu.tree_leaves(eqx_offload.to_device(on_host))):
        assert h.sharding == a.sharding.with_memory_kind("pinned_host") and b.sharding == a.sharding
        assert_tree_equal(b, a)
    batch = NamedSharding(mesh, P("data", None))
    data = [(jax.device_put(x, batch), jax.device_put(y, batch)) for x, y in batches()]
    out_sharding = batch if axis_type == AxisType.Explicit else None
    seen: list[tuple[Model, Any]] = []

    def check(model: Model, state: Any) -> None:
        check_placement(model, state, mesh)
        if not seen:
            assert_tree_equal(state.inner_state, optax.adamw(1e-2).init(eqx.filter(
                make_model(), eqx.is_array)))
        seen.append((model, state))

    with count_compiles("step") as compiles:
        model, state, losses = train(make_model(mesh, layout), eqx_offload.offloaded(
            optax.adamw(1e-2)), eqx_offload.filter_jit(donate="all"), data, out_sharding, check)
    assert len(compiles) == 1  # the outputs keep the inputs' shardings exactly
    check_placement(model, state, mesh)
    assert all(leaf.is_deleted() for leaf in jtu.tree_leaves(seen))
    ref = train(make_model(mesh, layout), optax.adamw(1e-2), eqx.filter_jit, data, out_sharding)
    assert_tree_equal((model, state.inner_state, losses), ref)
    one = train(make_model(), optax.adamw(1e-2), eqx.filter_jit, batches())
    for a, b in zip(jtu.tree_leaves((model, state.inner_state, losses)), jtu.tree_leaves(one)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)

    params = eqx.filter(make_model(), eqx.is_array)
    # Fresh arrays for each use: `jax.device_put` onto a replicated sharding may reuse a
    # one-device array's buffer for that device's shard, and the sharded run donates.
    grad_list = [jax.tree.map(lambda x, k=k: jnp.sin(x * (k + 2)), params) for k in range(STEPS)]

    def update(opt: Any, grads: Any, state: Any, p: Any) -> Any:
        updates, state = opt.update(grads, state, p)
        return eqx.apply_updates(p, updates), state

    opt, ref_opt = eqx_offload.offloaded(optax.adamw(1e-2)), optax.adamw(1e-2)
    sharded_update = eqx_offload.filter_jit(lambda *a: update(opt, *a), donate="all-except-first")
    ref_update = jax.jit(lambda *a: update(ref_opt, *a))
    sharded = eqx.filter(make_model(mesh, layout), eqx.is_array)
    state, ref_state = opt.init(sharded), ref_opt.init(params)
    for grads in grad_list:
        grads = jax.tree.map(lambda g, p: jax.device_put(g, p.sharding, may_alias=False),
                             grads, sharded)
        sharded, state = sharded_update(grads, state, sharded)
        params, ref_state = ref_update(grads, ref_state, params)
    check_placement(make_model(mesh, layout), state, mesh)
    assert_tree_equal((sharded, state.inner_state), (params, ref_state))


@AXIS_TYPES
def test_uncommitted_batch_with_sharded_model(axis_type: AxisType) -> None:
    """Uncommitted and NumPy batches are replicated, as `jax.jit` would."""
    mesh = make_mesh("data+model", axis_type)
    opt = eqx_offload.offloaded(optax.adamw(1e-2))
    replicated = NamedSharding(mesh, P())
    out_sharding = replicated if axis_type == AxisType.Explicit else None
    (x, y), (x2, y2) = batches()[:2]
    assert not x.committed
    model, state, _ = train(make_model(mesh, "data+model"), opt, eqx_offload.filter_jit(
        donate="all-except-first"), [(x, y), (np.asarray(x2), np.asarray(y2))], out_sharding)
    check_placement(model, state, mesh)
    data = [jax.device_put(pair, replicated) for pair in ((x, y), (x2, y2))]
    ref_model, _, _ = train(make_model(mesh, "data+model"), optax.adamw(1e-2), eqx.filter_jit,
                            data, out_sharding)
    assert_tree_equal(model, ref_model)


def test_same_shape_outputs_keep_their_own_sharding() -> None:
    """Auto axes: outputs of one shape keep their own shardings."""
    mesh = make_mesh("data+model", AxisType.Auto)
    w1 = jax.device_put(jnp.ones((DIM, DIM)), NamedSharding(mesh, P(None, "model")))
    w2 = jax.device_put(jnp.ones((DIM, DIM)), NamedSharding(mesh, P("model", None)))
    host = jax.device_put(jnp.ones((DIM, DIM)), NamedSharding(mesh, P("model", None),
                                                              memory_kind="pinned_host"))

    @eqx_offload.filter_jit
    def f(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
        on_host = jax.device_put(jax.device_put(tree["c"], jax.memory.Space.Device) * 2,
                                 jax.memory.Space.Host)
        return {"a": tree["a"] * 2, "b": tree["b"] * 2, "c": on_host}

    out = f({"a": w1, "b": w2, "c": host})
    assert [out[k].sharding for k in "abc"] == [w1.sharding, w2.sharding, host.sharding]


def test_filter_shard_idiom_bitwise_and_state_stays_on_host() -> None:
    """Equinox's data-parallel idiom with `eqx_offload.filter_shard` after `init` (eqx's
    cannot move committed host arrays): bitwise, the state stays on host."""
    mesh = make_mesh("data", AxisType.Auto)
    replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data", None))

    def shard_step(opt: Any, jit: Any) -> Any:
        @jit(donate="all")
        def step(model: Model, state: Any, x: jax.Array, y: jax.Array) -> Any:
            model, state = eqx.filter_shard((model, state), replicated)
            x, y = eqx.filter_shard((x, y), data)
            loss = lambda m: jnp.mean((m(x, None) - y) ** 2)  # noqa: E731
            value, grads = eqx.filter_value_and_grad(loss)(model)
            updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
            model = eqx.apply_updates(model, updates)
            return (*eqx.filter_shard((model, state), replicated), value)
        return step

    model, ref_opt, opt = make_model(), optax.adamw(1e-2), eqx_offload.offloaded(optax.adamw(1e-2))
    ref_model, ref_state = eqx.filter_shard((model, ref_opt.init(eqx.filter(model, eqx.is_array))),
                                            replicated)
    state = opt.init(eqx.filter(model, eqx.is_array))
    with pytest.raises(ValueError, match="incompatible devices"):  # upstream, eagerly
        eqx.filter_shard(state, replicated)
    model, state = eqx_offload.filter_shard((model, state), replicated)
    assert all(x.sharding == replicated.with_memory_kind("pinned_host")
               for x in jax.tree.leaves(state) if x.ndim)
    step, ref_step = shard_step(opt, eqx_offload.filter_jit), shard_step(ref_opt, eqx.filter_jit)
    for x, y in batches():
        x, y = eqx.filter_shard((x, y), data)
        ref_model, ref_state, ref_value = ref_step(ref_model, ref_state, x, y)
        model, state, value = step(model, state, x, y)
        assert_tree_equal((model, state.inner_state, value), (ref_model, ref_state, ref_value))
        for leaf in jax.tree.leaves(state):
            assert leaf.sharding.memory_kind == ("pinned_host" if leaf.ndim else "device")
            assert leaf.sharding.mesh == mesh


def test_filter_shard_under_jit_keeps_memory() -> None:
    """Eagerly a placement, under jit a constraint: memory kinds kept."""
    mesh = make_mesh("data", AxisType.Auto)
    tree = {"host": eqx_offload.to_host(jnp.arange(8.0)), "device": jnp.arange(4.0), "n": 3}
    eager = eqx_offload.filter_shard(tree, NamedSharding(mesh, P()))
    spread = NamedSharding(mesh, P("data"))
    jitted = eqx_offload.filter_jit(lambda t: eqx_offload.filter_shard(t, spread))(eager)
    assert jitted["host"].sharding.spec == P("data")
    for out in (eager, jitted):
        assert out["host"].sharding.memory_kind == "pinned_host"
        assert out["host"].sharding.mesh == mesh
        assert out["device"].sharding.memory_kind == "device" and out["n"] == 3
        assert_tree_equal(out, tree)
    with pytest.raises(eqx_offload.errors.OptionError, match="must be a `jax.sharding.Sharding`"):
        unchecked(eqx_offload.filter_shard)(tree, P())


# ---------------------------------------------------------------------------------------
# Every shard's data through every move, on a 4-device mesh


def _checksums(tree: Any) -> list[Any]:
    """Per array leaf: its memory kind, its values and each shard's values with index."""
    out = []
    for x in jtu.tree_leaves(tree):
        shards = sorted(((str(s.index), np.asarray(s.data).tobytes(), s.device.id)
                         for s in x.addressable_shards), key=lambda s: (s[2], s[0]))
        out.append((x.sharding.memory_kind, np.asarray(x).tobytes(), shards))
    return out


def _expected_shards(x: jax.Array, values: np.ndarray) -> None:
    for shard in x.addressable_shards:
        assert np.array_equal(np.asarray(shard.data), values[shard.index]), shard.device


MESHES = {"x": ((4,), ("x",), P("x")), "x_y": ((2, 2), ("x", "y"), P("x", "y")),
          "cols": ((2, 2), ("x", "y"), P(None, "y"))}


def _mesh(name: str) -> tuple[jax.sharding.Mesh, P, np.ndarray]:
    """The mesh on devices 4-7 (not the default device), its spec, and fresh (8, 12) values."""
    shape, names, spec = MESHES[name]
    devices = np.asarray(jax.devices()[4:8]).reshape(shape)
    values = (np.arange(8 * 12, dtype=np.float32).reshape(8, 12) - 40.0) / 3.0
    return jax.sharding.Mesh(devices, names), spec, values


@pytest.mark.parametrize("layout", sorted(MESHES))
def test_moves_keep_every_shard(layout: str) -> None:
    """`to_host` and back; `filter_shard` of a state made on one device onto the mesh (not
    replicated) and back onto one device."""
    mesh, spec, values = _mesh(layout)
    tree = {"a": jax.device_put(values, NamedSharding(mesh, spec)), "n": 3}
    host = eqx_offload.to_host(tree)
    assert host["a"].sharding.memory_kind == "pinned_host" and host["a"].sharding.spec == spec
    _expected_shards(host["a"], values)
    back = eqx_offload.to_device(host)
    assert back["a"].sharding.memory_kind == "device"
    _expected_shards(back["a"], values)
    state = eqx_offload.OffloadedState(
        optax.TraceState(trace={"w": eqx_offload.to_host(jnp.asarray(values))}))
    sharded = eqx_offload.filter_shard(state, NamedSharding(mesh, spec))
    leaf = sharded.inner_state.trace["w"]
    assert leaf.sharding.memory_kind == "pinned_host" and leaf.sharding.spec == spec
    assert leaf.sharding.device_set == set(mesh.devices.flat)
    _expected_shards(leaf, values)
    single = eqx_offload.filter_shard(sharded, jax.sharding.make_single_device_sharding(jax.devices()[0]))
    _expected_shards(single.inner_state.trace["w"], values)


@pytest.mark.parametrize("fmt", ["orbax", "eqx"])
@pytest.mark.parametrize("layout", sorted(MESHES))
def test_restores_keep_every_shard(layout: str, fmt: str, tmp_path: Path) -> None:
    """Two donated steps on the mesh, saved, restored into `abstract_init`'s targets."""
    mesh, spec, values = _mesh(layout)
    params = {"w": jax.device_put(jnp.asarray(values), NamedSharding(mesh, spec))}
    opt = eqx_offload.offloaded(optax.adam(1e-2))

    @eqx_offload.filter_jit(donate="all-except-first")
    def step(params, state):
        updates, state = opt.update(jax.tree.map(lambda p: jnp.sin(p) * 0.5, params), state, params)
        return state

    state = step(params, step(params, opt.init(params)))
    target = eqx_offload.checkpoint.abstract_init(opt, params)
    if fmt == "orbax":
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp_path / "state", state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "state", target)
        checkpointer.close()
    else:
        eqx.tree_serialise_leaves(tmp_path / "state.eqx", state)
        restored = eqx.tree_deserialise_leaves(tmp_path / "state.eqx", target,
                                               filter_spec=eqx_offload.checkpoint.deserialise_filter_spec)
    assert _checksums(restored) == _checksums(state)
    for leaf in jtu.tree_leaves(restored):
        if leaf.ndim:
            assert leaf.sharding.spec == params["w"].sharding.spec
            assert leaf.sharding.memory_kind == "pinned_host"

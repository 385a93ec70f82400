"""Checkpoints of offloaded optimizer states: orbax-checkpoint and
`eqx.tree_serialise_leaves`, on one device and on a sharded mesh.

What is checked: a restore lands the offloaded leaves directly in host memory (every
`jax.device_put` made while restoring targets host memory for them: no full-size
device copy on the way), with the mesh and `PartitionSpec` of the saved state; resuming
gives a trajectory bitwise equal to the uninterrupted one; a process killed in the
middle of a save leaves the previous checkpoint loadable.
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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
from helpers import count_compiles
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqx_offload


# ---------------------------------------------------------------------------------------
# A small sharded training run.

SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
DIM = 8


def make_params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.standard_normal((DIM, DIM), np.float32) / 3),
        "b1": jnp.asarray(rng.standard_normal((DIM,), np.float32) / 3),
        "w2": jnp.asarray(rng.standard_normal((DIM, DIM), np.float32) / 3),
        "b2": jnp.asarray(rng.standard_normal((DIM,), np.float32) / 3),
    }


def batches(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((8, DIM), np.float32), rng.standard_normal((8, DIM), np.float32))
            for _ in range(n)]


def mesh_for(layout: str) -> Optional[jax.sharding.Mesh]:
    if layout == "one-device":
        return None
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def place(params: dict[str, jax.Array], mesh: Optional[jax.sharding.Mesh]) -> dict[str, jax.Array]:
    if mesh is None:
        return params
    return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}


def place_batch(x: np.ndarray, mesh: Optional[jax.sharding.Mesh]) -> jax.Array:
    if mesh is None:
        return jax.device_put(x, jax.devices()[0])
    return jax.device_put(x, NamedSharding(mesh, P("data", None)))


def make_opt() -> optax.GradientTransformation:
    return eqx_offload.offloaded(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)))


def make_step(opt: optax.GradientTransformation) -> Callable[..., Any]:
    def loss(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    @eqx_offload.filter_jit(donate="all")
    def step(p: Any, s: Any, x: jax.Array, y: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    return step


def run(params: Any, state: Any, step: Callable[..., Any], data: list[Any],
        mesh: Optional[jax.sharding.Mesh]) -> tuple[Any, Any, list[jax.Array]]:
    losses = []
    for x, y in data:
        params, state, value = step(params, state, place_batch(x, mesh), place_batch(y, mesh))
        losses.append(value)
    return params, state, losses


# ---------------------------------------------------------------------------------------
# Helpers.


def bits(tree: Any) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """Path, dtype, shape and raw bytes of every array leaf (read on the host: no
    arithmetic on host-resident arrays)."""
    return [
        (jtu.keystr(p), str(x.dtype), tuple(x.shape), np.asarray(x).tobytes())
        for p, x in jtu.tree_flatten_with_path(tree)[0]
    ]


def placements(tree: Any) -> list[tuple[str, Optional[str], Any, Any]]:
    """Path, memory kind, devices and the index of every shard, per leaf: two leaves with
    equal placements hold the same bytes in the same memories, whichever `Sharding`
    class describes them."""
    return [
        (jtu.keystr(p), x.sharding.memory_kind,
         sorted((d.id, str(i)) for d, i in x.sharding.devices_indices_map(tuple(x.shape)).items()), None)
        for p, x in jtu.tree_flatten_with_path(tree)[0]
    ]


def host_typed(x: jax.Array) -> bool:
    """JAX's type of `x` says host memory (what `jax.jit` traces it as)."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


class DevicePutSpy:
    """Records the memory kind of every `jax.device_put` destination (orbax and
    `deserialise_filter_spec` place each shard with `jax.device_put`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[tuple[int, ...], Optional[str]]] = []
        original = jax.device_put

        def spy(x: Any, device: Any = None, *args: Any, **kwargs: Any) -> Any:
            pairs = zip(x, device) if isinstance(x, (list, tuple)) else [(x, device)]
            for value, destination in pairs:
                destination = getattr(destination, "sharding", destination)  # a `Format` wraps one
                self.calls.append((tuple(value.shape), getattr(destination, "memory_kind", None)))
            return original(x, device, *args, **kwargs)

        monkeypatch.setattr(jax, "device_put", spy)


def offloaded_leaves(state: eqx_offload.OffloadedState) -> list[jax.Array]:
    return [x for x in jtu.tree_leaves(state) if x.ndim >= 1]


def assert_restored_on_host(restored: Any, saved: Any, spy: DevicePutSpy) -> None:
    """The restored state has the saved state's values, shardings and memory kinds, and
    no non-scalar leaf passed through device memory on the way."""
    assert bits(restored) == bits(saved)
    assert placements(restored) == placements(saved)
    big = offloaded_leaves(restored)
    assert big and all(x.sharding.memory_kind == "pinned_host" and host_typed(x) for x in big)
    shapes = {tuple(x.addressable_shards[0].data.shape) for x in big} | {x.shape for x in big}
    to_device = [c for c in spy.calls if c[1] != "pinned_host" and c[0] in shapes and c[0] != ()]
    assert spy.calls, "the spy saw no device_put: the restore path changed"
    assert not to_device, to_device


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "ckpt"


LAYOUTS = pytest.mark.parametrize("layout", ["one-device", "mesh"])


# ---------------------------------------------------------------------------------------
# The helpers.


@LAYOUTS
def test_abstract_init_is_what_init_makes(layout: str) -> None:
    mesh = mesh_for(layout)
    params = place(make_params(), mesh)
    for opt in [
        make_opt(),
        eqx_offload.offloaded(optax.adam(1e-3), where=eqx_offload.pattern(".*/nu/.*")),
        eqx_offload.offloaded(optax.sgd(1e-3, momentum=0.9)),
    ]:
        state = opt.init(params)
        target = eqx_offload.abstract_init(opt, params)
        assert jtu.tree_structure(target) == jtu.tree_structure(state)
        for (path, t), s in zip(jtu.tree_flatten_with_path(target)[0], jtu.tree_leaves(state)):
            assert isinstance(t, jax.ShapeDtypeStruct)
            assert (t.shape, t.dtype) == (s.shape, s.dtype), path
            assert t.sharding.memory_kind == s.sharding.memory_kind, path
            assert t.sharding.is_equivalent_to(s.sharding, s.ndim), (path, t.sharding, s.sharding)
            if mesh is not None:
                assert t.sharding == s.sharding, (path, t.sharding, s.sharding)
            elif t.sharding.memory_kind == "pinned_host":
                # One device in host memory: a one-device `NamedSharding`, because JAX
                # types shards assembled into a `SingleDeviceSharding` as device memory.
                assert isinstance(t.sharding, NamedSharding) and t.sharding.mesh.size == 1
        # From abstract params (nothing allocated): the same.
        abstract_params = eqx_offload.restore_target(params)
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jtu.tree_leaves(abstract_params))
        assert placements(eqx_offload.abstract_init(opt, abstract_params)) == placements(target)


def test_host_shardings_and_restore_target() -> None:
    mesh = mesh_for("mesh")
    params = place(make_params(), mesh)
    plain = optax.adam(1e-3).init(params)  # as restored without host shardings: on device
    shardings = eqx_offload.host_shardings(plain, eqx_offload.min_ndim(1))
    assert shardings[0].count == plain[0].count.sharding
    for k in SPECS:
        assert shardings[0].mu[k] == params[k].sharding.with_memory_kind("pinned_host")
    assert shardings[1] == optax.EmptyState()

    # restore_target keeps placements by default, `where` adds host leaves.
    target = eqx_offload.restore_target(plain)
    assert placements(target) == placements(plain)
    target = eqx_offload.restore_target(plain, eqx_offload.pattern(".*mu/.*"), memory_kind="unpinned_host")
    assert target[0].mu["w1"].sharding == params["w1"].sharding.with_memory_kind("unpinned_host")
    assert target[0].nu["w1"].sharding == params["w1"].sharding
    # Abstract leaves without a sharding (from `jax.eval_shape`) go to the default device.
    abstract = jax.eval_shape(optax.adam(1e-3).init, make_params())
    target = eqx_offload.restore_target(abstract, True)
    assert target[0].mu["w1"].sharding.memory_kind == "pinned_host"
    assert target[0].mu["w1"].sharding.device_set == {jax.devices()[0]}
    assert target[0].mu["w1"].sharding.is_fully_replicated
    # Non-array leaves pass through.
    assert eqx_offload.restore_target({"a": 1.5, "b": None, "c": "x"}) == {"a": 1.5, "b": None, "c": "x"}


def unchecked(f: Callable[..., Any]) -> Callable[..., Any]:
    """`f` without the jaxtyping/beartype wrapper the pytest hook adds, to reach the
    library's own checks with values the type hints forbid (as a user without the hook
    would)."""
    return getattr(f, "__wrapped__", f)


def test_helpers_reject_bad_memory_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(eqx_offload.MemoryKindError, match="memory_kind='device'.*host memory kind"):
        unchecked(eqx_offload.host_shardings)({"w": jnp.ones(3)}, memory_kind="device")
    with pytest.raises(eqx_offload.MemoryKindError, match="memory_kind='hbm'"):
        unchecked(eqx_offload.restore_target)({"w": jnp.ones(3)}, memory_kind="hbm")
    # A kind the backend lacks: names the leaf and what the device offers.
    monkeypatch.setattr("eqx_offload._memory.device_memory_kinds", lambda device: ("device", "pinned_host"))
    with pytest.raises(eqx_offload.MemoryKindError, match=r"memory_kind='unpinned_host'.*leaf 0/count does not offer.*'device', 'pinned_host'"):
        eqx_offload.host_shardings(optax.adam(1e-3).init({"w": jnp.ones(3)}), memory_kind="unpinned_host")


def test_deserialise_rejects_mismatched_leaf(tmp_path: Path) -> None:
    path = tmp_path / "s.eqx"
    eqx.tree_serialise_leaves(path, {"w": jnp.ones((3, 4))})
    with pytest.raises(Exception) as info:
        eqx.tree_deserialise_leaves(path, {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)},
                                    filter_spec=eqx_offload.deserialise_filter_spec)
    # Equinox wraps it in a `TreePathError` naming the leaf; ours is the cause.
    assert "DictKey(key='w')" in str(info.value)
    cause: Optional[BaseException] = info.value
    while cause is not None and not isinstance(cause, eqx_offload.CheckpointError):
        cause = cause.__cause__
    assert isinstance(cause, ValueError)
    assert "float32[3, 4] where `like` has float32[4, 3]" in str(cause)


def test_deserialise_keeps_bfloat16_and_numpy(tmp_path: Path) -> None:
    tree = {"b": jnp.arange(4, dtype=jnp.bfloat16), "n": np.arange(3.0), "s": 2.0}
    path = tmp_path / "s.eqx"
    eqx.tree_serialise_leaves(path, tree)
    like = {"b": eqx_offload.restore_target(tree["b"], True), "n": np.zeros(3), "s": 0.0}
    out = eqx.tree_deserialise_leaves(path, like, filter_spec=eqx_offload.deserialise_filter_spec)
    assert out["b"].dtype == jnp.bfloat16 and out["b"].sharding.memory_kind == "pinned_host"
    assert np.asarray(out["b"]).tobytes() == np.asarray(tree["b"]).tobytes()
    assert isinstance(out["n"], np.ndarray) and np.array_equal(out["n"], tree["n"])
    assert out["s"] == 2.0


# ---------------------------------------------------------------------------------------
# Restoring into host memory.


@LAYOUTS
def test_orbax_restores_into_host(layout: str, ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = mesh_for(layout)
    opt = make_opt()
    params = place(make_params(), mesh)
    params, state, _ = run(params, opt.init(params), make_step(opt), batches(2), mesh)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(ckpt_dir / "state", state)
    checkpointer.wait_until_finished()

    # Orbax records meshes and specs but not memory kinds: without a target the state
    # comes back whole in device memory (and as plain lists and dicts).
    naive = checkpointer.restore(ckpt_dir / "state")
    assert {x.sharding.memory_kind for x in jtu.tree_leaves(naive)} == {"device"}

    target = eqx_offload.abstract_init(opt, params)
    spy = DevicePutSpy(monkeypatch)
    restored = checkpointer.restore(ckpt_dir / "state", target)
    monkeypatch.undo()
    assert isinstance(restored, eqx_offload.OffloadedState)
    assert_restored_on_host(restored, state, spy)


@LAYOUTS
def test_eqx_serialise_restores_into_host(layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = mesh_for(layout)
    opt = make_opt()
    params = place(make_params(), mesh)
    params, state, _ = run(params, opt.init(params), make_step(opt), batches(2), mesh)
    path = tmp_path / "state.eqx"
    eqx.tree_serialise_leaves(path, state)

    # Equinox's default filter spec loads every array whole onto the default device.
    naive = eqx.tree_deserialise_leaves(path, state)
    assert {(x.sharding.memory_kind, len(x.sharding.device_set)) for x in jtu.tree_leaves(naive)} == {("device", 1)}

    target = eqx_offload.abstract_init(opt, params)
    spy = DevicePutSpy(monkeypatch)
    restored = eqx.tree_deserialise_leaves(path, target,
                                           filter_spec=eqx_offload.deserialise_filter_spec)
    monkeypatch.undo()
    assert_restored_on_host(restored, state, spy)


# ---------------------------------------------------------------------------------------
# Resuming.


def save_orbax(directory: Path, params: Any, state: Any) -> None:
    manager = ocp.CheckpointManager(directory)
    manager.save(3, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                            state=ocp.args.StandardSave(state)))
    manager.wait_until_finished()
    manager.close()


def load_orbax(directory: Path, params_target: Any, state_target: Any) -> tuple[Any, Any]:
    manager = ocp.CheckpointManager(directory)
    assert manager.latest_step() == 3
    restored = manager.restore(3, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params_target), state=ocp.args.StandardRestore(state_target)))
    manager.close()
    return restored.params, restored.state


def save_eqx(directory: Path, params: Any, state: Any) -> None:
    directory.mkdir(parents=True)
    eqx.tree_serialise_leaves(directory / "3.eqx", (params, state))


def load_eqx(directory: Path, params_target: Any, state_target: Any) -> tuple[Any, Any]:
    out: tuple[Any, Any] = eqx.tree_deserialise_leaves(
        directory / "3.eqx", (params_target, state_target), filter_spec=eqx_offload.deserialise_filter_spec)
    return out


@LAYOUTS
@pytest.mark.parametrize("fmt", ["orbax", "eqx"])
def test_resume_is_bitwise_equal(layout: str, fmt: str, ckpt_dir: Path) -> None:
    mesh = mesh_for(layout)
    data = batches(6)

    opt = make_opt()
    params = place(make_params(), mesh)
    full_params, full_state, full_losses = run(params, opt.init(params), make_step(opt), data, mesh)

    # Three steps, save, and forget everything.
    opt = make_opt()
    params = place(make_params(), mesh)
    params, state, losses = run(params, opt.init(params), make_step(opt), data[:3], mesh)
    (save_orbax if fmt == "orbax" else save_eqx)(ckpt_dir, params, state)
    params_target = eqx_offload.restore_target(params)
    del params, state

    # As a new run would: a new optimizer, new targets, a new step function.
    opt = make_opt()
    state_target = eqx_offload.abstract_init(opt, params_target)
    params, state = (load_orbax if fmt == "orbax" else load_eqx)(ckpt_dir, params_target, state_target)
    for x, t in zip(jtu.tree_leaves(state), jtu.tree_leaves(state_target)):
        assert x.sharding == t.sharding
        assert host_typed(x) == (t.sharding.memory_kind == "pinned_host")
    step = make_step(opt)
    with count_compiles("step") as compiles:
        params, state, more = run(params, state, step, data[3:], mesh)

    assert bits(params) == bits(full_params)
    assert bits(state) == bits(full_state)
    assert bits(losses + more) == bits(full_losses)
    assert placements(state) == placements(full_state)
    assert len(compiles) == 1  # restored placements hit the same executable


# ---------------------------------------------------------------------------------------
# Killed in the middle of a save.

WORKER = Path(__file__).with_name("ckpt_worker.py")


def start_and_kill(directory: Path, mode: str) -> str:
    """Runs the worker until it says it is in the middle of saving step 2, then SIGKILLs
    it. Returns its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    log_path = directory / "worker.log"
    with open(log_path, "w+b") as log:
        proc = subprocess.Popen([sys.executable, str(WORKER), str(directory), mode], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while b"SAVING" not in log_path.read_bytes():
                assert proc.poll() is None, f"worker exited early:\n{log_path.read_text()[-4000:]}"
                assert time.monotonic() < deadline, f"worker never reached the save:\n{log_path.read_text()[-4000:]}"
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return log_path.read_text()


def expected_from(directory: Path) -> list[tuple[str, bytes]]:
    expected = np.load(directory / "expected.npz")
    return [(k, expected[k].tobytes()) for k in expected.files]


def flat_bits(tree: Any) -> list[tuple[str, bytes]]:
    return [(jtu.keystr(p), np.asarray(x).tobytes()) for p, x in jtu.tree_flatten_with_path(tree)[0]]


def worker_targets() -> tuple[Any, Any]:
    params = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
              "b": jax.ShapeDtypeStruct((64,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    return params, eqx_offload.abstract_init(eqx_offload.offloaded(optax.adamw(1e-2)), params)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["orbax-writing", "orbax-committing"])
def test_killed_during_orbax_save_keeps_previous(mode: str, tmp_path: Path) -> None:
    start_and_kill(tmp_path, mode)
    # Step 2 was started (its temporary directory is there) but never committed.
    assert any(p.name.startswith("2.") and "tmp" in p.name for p in (tmp_path / "ckpt").iterdir())
    manager = ocp.CheckpointManager(tmp_path / "ckpt")
    assert manager.all_steps() == [1]
    params_target, state_target = worker_targets()
    restored = manager.restore(1, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(params_target), state=ocp.args.StandardRestore(state_target)))
    manager.close()
    assert flat_bits((restored.params, restored.state)) == expected_from(tmp_path)
    assert all(x.sharding.memory_kind == "pinned_host" for x in offloaded_leaves(restored.state))


@pytest.mark.slow
def test_killed_during_eqx_save_keeps_previous(tmp_path: Path) -> None:
    start_and_kill(tmp_path, "eqx")
    partial = tmp_path / "step_2.eqx.tmp"
    assert partial.exists() and not (tmp_path / "step_2.eqx").exists()
    params_target, state_target = worker_targets()
    # The torn file: its second leaf was never written. (Equinox's `TreePathError` is a
    # `RuntimeError` naming the leaf.)
    with pytest.raises(RuntimeError, match=r"Error at leaf with path \(SequenceKey\(idx=0\), DictKey\(key='w'\)\)"):
        eqx.tree_deserialise_leaves(partial, (params_target, state_target),
                                    filter_spec=eqx_offload.deserialise_filter_spec)
    restored = eqx.tree_deserialise_leaves(tmp_path / "step_1.eqx", (params_target, state_target),
                                           filter_spec=eqx_offload.deserialise_filter_spec)
    assert flat_bits(restored) == expected_from(tmp_path)


def test_filter_jit_retypes_host_arrays_assembled_from_shards() -> None:
    """A state built the way orbax restores (shards assembled into a `SingleDeviceSharding`
    array) is typed as device memory by JAX 0.10 although it lives in host memory.
    `filter_jit` copies such leaves once into correctly typed arrays: no `OffloadWarning`
    (an error under this suite's filterwarnings), the same numbers, donation honoured."""
    opt = make_opt()
    step = make_step(opt)
    params = make_params()
    state = opt.init(params)
    x, y = batches(1)[0]

    def assembled(leaf: jax.Array) -> jax.Array:
        value = np.asarray(leaf)
        return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index: value[index])

    rebuilt = jax.tree.map(assembled, state)
    host = offloaded_leaves(rebuilt)
    assert all(x.sharding.memory_kind == "pinned_host" and not host_typed(x) for x in host)
    assert bits(rebuilt) == bits(state)

    new_params, new_state, loss = step(jax.tree.map(jnp.copy, params), rebuilt, place_batch(x, None), place_batch(y, None))
    assert all(x.is_deleted() for x in jtu.tree_leaves(rebuilt))
    ref_params, ref_state, ref_loss = step(params, state, place_batch(x, None), place_batch(y, None))
    assert bits((new_params, new_state, loss)) == bits((ref_params, ref_state, ref_loss))
    assert all(host_typed(x) for x in offloaded_leaves(new_state))

"""Restoring offloaded states straight into host memory (orbax and Equinox, one device and a
mesh); resuming bitwise; a save killed midway; saving moves nothing to the device and does
not double host memory; a soak of donated steps leaks nothing."""

import gc
import json
import os
import re
import signal
import tempfile
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
from helpers import count_compiles, hex_bits, tree_bits as bits, unchecked
from helpers import host_typed, offloaded_leaves, worker_opt, worker_params, worker_train
from isolated import call_isolated, run_isolated
from jax.sharding import AxisType, NamedSharding
from mp_worker import make_step, SPECS

import eqx_offload


LAYOUTS = pytest.mark.parametrize("layout", ["one-device", "mesh"])
FILTER = eqx_offload.checkpoint.deserialise_filter_spec


def mesh_for(layout: str) -> Optional[jax.sharding.Mesh]:
    return None if layout == "one-device" else jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def placements(tree: Any) -> list[tuple[str, Optional[str], Any]]:
    """Path, memory kind and each device's shard index, per leaf."""
    return [(jtu.keystr(p), x.sharding.memory_kind, sorted(
        (d.id, str(i)) for d, i in x.sharding.devices_indices_map(tuple(x.shape)).items()))
            for p, x in jtu.tree_flatten_with_path(tree)[0]]


def device_put_spy(calls: list[Any]) -> Callable[..., Any]:
    """`jax.device_put`, appending the shape and destination memory kind of each array."""
    original = jax.device_put

    def spy(x: Any, device: Any = None, *args: Any, **kwargs: Any) -> Any:
        xs = x if isinstance(x, (list, tuple)) else [x]
        tos = device if isinstance(device, (list, tuple)) else [device] * len(xs)
        for value, to in zip(xs, tos):
            to = getattr(to, "sharding", to)  # a `Format` wraps one
            calls.append((np.shape(value), getattr(to, "memory_kind", None)))
        return original(x, device, *args, **kwargs)

    return spy


@LAYOUTS
def test_abstract_init_is_what_init_makes(layout: str) -> None:
    """Shapes, dtypes, memory kinds and shardings of `init`'s state."""
    mesh = mesh_for(layout)
    params = worker_params(mesh)
    for opt in [worker_opt(), eqx_offload.offloaded(optax.sgd(1e-3, momentum=0.9)),
                eqx_offload.offloaded(optax.adam(1e-3), where=eqx_offload.pattern(".*/nu/.*"))]:
        state, target = opt.init(params), eqx_offload.checkpoint.abstract_init(opt, params)
        assert jtu.tree_structure(target) == jtu.tree_structure(state)
        for (path, t), s in zip(jtu.tree_flatten_with_path(target)[0], jtu.tree_leaves(state)):
            assert isinstance(t, jax.ShapeDtypeStruct) and (t.shape, t.dtype) == (s.shape, s.dtype)
            assert t.sharding.memory_kind == s.sharding.memory_kind, path
            assert t.sharding.is_equivalent_to(s.sharding, s.ndim), (path, t.sharding, s.sharding)
            if mesh is not None:
                assert t.sharding == s.sharding, path
            elif t.sharding.memory_kind == "pinned_host":
                assert isinstance(t.sharding, NamedSharding) and t.sharding.mesh.size == 1
        abstract = eqx_offload.checkpoint.restore_target(params)
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jtu.tree_leaves(abstract))
        assert placements(eqx_offload.checkpoint.abstract_init(opt, abstract)) == placements(target)


def test_host_shardings_and_restore_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host shardings keep mesh and spec; bad kinds name the leaf."""
    params = worker_params(mesh_for("mesh"))
    plain = optax.adam(1e-3).init(params)  # as restored without host shardings
    shardings = eqx_offload.checkpoint.host_shardings(plain, eqx_offload.min_ndim(1))
    host = {k: params[k].sharding.with_memory_kind("pinned_host") for k in SPECS}
    assert shardings[0].count == plain[0].count.sharding and shardings[0].mu == host
    assert shardings[1] == optax.EmptyState()
    assert placements(eqx_offload.checkpoint.restore_target(plain)) == placements(plain)
    mu = eqx_offload.pattern(".*mu/.*")
    target = eqx_offload.checkpoint.restore_target(plain, mu, memory_kind="unpinned_host")
    assert target[0].mu["w1"].sharding == params["w1"].sharding.with_memory_kind("unpinned_host")
    assert target[0].nu["w1"].sharding == params["w1"].sharding
    abstract = jax.eval_shape(optax.adam(1e-3).init, worker_params())  # leaves without a sharding
    w1 = eqx_offload.checkpoint.restore_target(abstract, True)[0].mu["w1"].sharding
    assert w1.memory_kind == "pinned_host" and w1.is_fully_replicated
    assert w1.device_set == {jax.devices()[0]}
    other = {"a": 1.5, "b": None, "c": "x"}
    assert eqx_offload.checkpoint.restore_target(other) == other
    with pytest.raises(eqx_offload.errors.MemoryKindError, match="memory_kind='device'.*host memory kind"):
        unchecked(eqx_offload.checkpoint.host_shardings)({"w": jnp.ones(3)}, memory_kind="device")
    with pytest.raises(eqx_offload.errors.MemoryKindError, match="memory_kind='hbm'"):
        unchecked(eqx_offload.checkpoint.restore_target)({"w": jnp.ones(3)}, memory_kind="hbm")
    monkeypatch.setattr("eqx_offload._core.memory.device_memory_kinds",
                        lambda d: ("device", "pinned_host"))
    with pytest.raises(eqx_offload.errors.MemoryKindError, match=r"memory_kind='unpinned_host'.*leaf "
                       r"0/count does not offer.*'device', 'pinned_host'"):
        eqx_offload.checkpoint.host_shardings(plain, memory_kind="unpinned_host")


def test_deserialise_filter_spec(tmp_path: Path) -> None:
    """bfloat16 and NumPy leaves round-trip; a mismatch names the leaf; a restored host layer
    stack works as a freshly offloaded one."""
    tree = {"b": jnp.arange(4, dtype=jnp.bfloat16), "n": np.arange(3.0), "s": 2.0}
    eqx.tree_serialise_leaves(tmp_path / "s.eqx", tree)
    like = {"b": eqx_offload.checkpoint.restore_target(tree["b"], True), "n": np.zeros(3), "s": 0.0}
    out = eqx.tree_deserialise_leaves(tmp_path / "s.eqx", like, filter_spec=FILTER)
    assert out["b"].dtype == jnp.bfloat16 and out["b"].sharding.memory_kind == "pinned_host"
    assert bits(out) == bits(tree) and isinstance(out["n"], np.ndarray) and out["s"] == 2.0
    eqx.tree_serialise_leaves(tmp_path / "w.eqx", {"w": jnp.ones((3, 4))})
    like = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}
    with pytest.raises(Exception) as info:
        eqx.tree_deserialise_leaves(tmp_path / "w.eqx", like, filter_spec=FILTER)
    assert "DictKey(key='w')" in str(info.value)
    cause: Optional[BaseException] = info.value
    while cause is not None and not isinstance(cause, eqx_offload.errors.CheckpointError):
        cause = cause.__cause__
    assert isinstance(cause, ValueError)
    assert "float32[3, 4] where `like` has float32[4, 3]" in str(cause)
    keys = jax.random.split(jax.random.key(0), 3)
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(keys)
    eqx.tree_serialise_leaves(tmp_path / "layers.eqx", layers)
    restored = eqx.tree_deserialise_leaves(tmp_path / "layers.eqx", eqx_offload.checkpoint.restore_target(
        layers, where=True), filter_spec=FILTER)
    assert all(x.sharding.memory_kind == "pinned_host" and host_typed(x)
               for x in jtu.tree_leaves(restored))
    assert bits(restored) == bits(layers)
    grad = jax.jit(jax.grad(lambda stack: jnp.sum(eqx_offload.scan_layers(
        stack, jnp.ones(8), lambda layer, h: jnp.tanh(layer(h))) ** 2)))
    assert bits(grad(restored)) == bits(grad(eqx_offload.to_host(layers)))


def test_tree_deserialise_leaves_raises_the_checkpoint_error(tmp_path: Path) -> None:
    """A resume into a `like` made for other parameters: `except CheckpointError` catches
    it, the fix first, the leaf's path; a fitting `like` restores into host memory."""
    opt = eqx_offload.offloaded(optax.adam(1e-3))
    params = {"w": jnp.ones((3, 4))}
    state = opt.init(params)
    eqx.tree_serialise_leaves(tmp_path / "state.eqx", state)
    wrong = eqx_offload.checkpoint.abstract_init(opt, {"w": jnp.ones((4, 3))})
    with pytest.raises(eqx_offload.errors.CheckpointError) as caught:
        eqx_offload.checkpoint.tree_deserialise_leaves(tmp_path / "state.eqx", wrong)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("Build `like` for the same model and optimizer")
    assert lines[1] == ("tree_deserialise_leaves: leaf .inner_state[0].mu['w']: the checkpoint "
                        "holds float32[3, 4] where `like` has float32[4, 3].")
    assert len(lines) == 3 and lines[2].endswith("#a-checkpoint-that-does-not-fit.")
    restored = eqx_offload.checkpoint.tree_deserialise_leaves(tmp_path / "state.eqx",
                                                   eqx_offload.checkpoint.abstract_init(opt, params))
    assert bits(restored) == bits(state)
    assert restored.inner_state[0].nu["w"].sharding.memory_kind == "pinned_host"


def save(fmt: str, directory: Path, tree: dict[str, Any], step: int = 3,
         spec: Any = eqx.default_serialise_filter_spec) -> None:
    """An orbax step, or an Equinox file per item renamed into place once complete."""
    if fmt == "orbax":
        with ocp.CheckpointManager(directory) as manager:
            manager.save(step, args=ocp.args.Composite(
                **{k: ocp.args.StandardSave(v) for k, v in tree.items()}))
            manager.wait_until_finished()
        return
    directory.mkdir(parents=True, exist_ok=True)
    for key, value in tree.items():
        path = directory / f"{step}.{key}.eqx"
        eqx.tree_serialise_leaves(f"{path}.tmp", value, filter_spec=spec)
        os.replace(f"{path}.tmp", path)


def load(fmt: str, directory: Path, targets: dict[str, Any], step: int = 3) -> dict[str, Any]:
    if fmt == "eqx":
        return {k: eqx.tree_deserialise_leaves(directory / f"{step}.{k}.eqx", t, filter_spec=FILTER)
                for k, t in targets.items()}
    with ocp.CheckpointManager(directory) as manager:
        restored = manager.restore(step, args=ocp.args.Composite(
            **{k: ocp.args.StandardRestore(t) for k, t in targets.items()}))
    return {k: restored[k] for k in targets}


@LAYOUTS
@pytest.mark.parametrize("fmt", ["orbax", "eqx"])
def test_resume_is_bitwise_equal(layout: str, fmt: str, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Restored straight into host memory as a new run would: one compile, bitwise."""
    mesh, opt = mesh_for(layout), worker_opt()
    full = worker_train(worker_params(mesh), opt.init(worker_params(mesh)), make_step(opt), range(6), mesh)
    opt = worker_opt()
    params, state, losses = worker_train(worker_params(mesh), opt.init(worker_params(mesh)),
                                  make_step(opt), range(3), mesh)
    save(fmt, tmp_path, {"params": params, "state": state})
    # Neither format records memory kinds: without a target the state comes back in device
    # memory (Equinox: whole on the default device).
    naive = jtu.tree_leaves(ocp.StandardCheckpointer().restore(tmp_path / "3" / "state")
                            if fmt == "orbax" else
                            eqx.tree_deserialise_leaves(tmp_path / "3.state.eqx", state))
    assert {x.sharding.memory_kind for x in naive} == {"device"}
    assert fmt == "orbax" or {len(x.sharding.device_set) for x in naive} == {1}
    targets = {"params": eqx_offload.checkpoint.restore_target(params)}
    del params, state, naive
    opt = worker_opt()
    targets["state"] = eqx_offload.checkpoint.abstract_init(opt, targets["params"])
    device_puts: list[tuple[tuple[int, ...], Optional[str]]] = []
    monkeypatch.setattr(jax, "device_put", device_put_spy(device_puts))
    state = load(fmt, tmp_path, {"state": targets["state"]})["state"]
    big = offloaded_leaves(state)
    shapes = {x.shape for x in big} | {x.addressable_shards[0].data.shape for x in big}
    assert device_puts, "the spy saw no device_put: the restore path changed"
    assert not [c for c in device_puts if c[1] != "pinned_host" and c[0] in shapes]
    for x, t in zip(jtu.tree_leaves(state), jtu.tree_leaves(targets["state"])):
        assert x.sharding == t.sharding
        assert host_typed(x) == (t.sharding.memory_kind == "pinned_host")
    params = load(fmt, tmp_path, {"params": targets["params"]})["params"]
    with count_compiles("step") as compiles:
        params, state, more = worker_train(params, state, make_step(opt), range(3, 6), mesh)
    assert len(compiles) == 1
    assert bits((params, state, losses + more)) == bits(full)
    assert placements(state) == placements(full[1])


def killed_save_child(directory: str, mode: str) -> None:
    """Saves step 1, then is killed (SIGKILL, by itself) in the middle of saving step 2."""
    from orbax.checkpoint._src.path import atomicity
    from orbax.checkpoint._src.serialization import serialization

    def stop(*args: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    written: list[bool] = []
    write = serialization.async_serialize_from_host

    def first_leaf_then_stop(f: Any, x: Any) -> None:
        if written:
            f.flush()
            stop()
        written.append(True)
        eqx.default_serialise_filter_spec(f, x)

    async def first_array_then_stop(*args: Any, **kwargs: Any) -> Any:
        if written:
            stop()
        written.append(True)
        return await write(*args, **kwargs)

    async def stop_before_commit(self: Any) -> None:
        stop()

    fmt, opt = mode.split("-")[0], worker_opt()
    step = make_step(opt)
    params, state, _ = worker_train(worker_params(), opt.init(worker_params()), step, range(1))
    save(fmt, Path(directory, "ckpt"), {"params": params, "state": state}, step=1)
    Path(directory, "expected.json").write_text(json.dumps(hex_bits([params, state])))
    params, state, _ = worker_train(params, state, step, range(1, 2))
    if mode == "orbax-writing":
        serialization.async_serialize_from_host = first_array_then_stop
    if mode == "orbax-committing":
        commit = atomicity.AtomicRenameTemporaryPath
        commit.finalize = stop_before_commit  # type: ignore[method-assign]  # the point of the test
    save(fmt, Path(directory, "ckpt"), {"params": params, "state": state}, step=2,
         spec=first_leaf_then_stop)
    print("FINISHED (this process should have been killed)", flush=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["orbax-writing", "orbax-committing", "eqx-writing"])
def test_killed_during_save_keeps_previous(mode: str, tmp_path: Path) -> None:
    """Killed mid-save, step 2 is not committed; step 1 restores bitwise."""
    child = run_isolated(killed_save_child, str(tmp_path), mode)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    ckpt, params_target = tmp_path / "ckpt", eqx_offload.checkpoint.restore_target(worker_params())
    targets = {"params": params_target,
               "state": eqx_offload.checkpoint.abstract_init(worker_opt(), params_target)}
    fmt = mode.split("-")[0]
    if fmt == "eqx":
        assert not (ckpt / "2.params.eqx").exists()
        # (Equinox's `TreePathError` is a `RuntimeError` naming the leaf.)
        with pytest.raises(RuntimeError, match=r"path \(DictKey\(key='b2'\),\)"):
            eqx.tree_deserialise_leaves(ckpt / "2.params.eqx.tmp", targets["params"],
                                        filter_spec=FILTER)
    else:
        assert any(p.name.startswith("2.") and "tmp" in p.name for p in ckpt.iterdir())
        with ocp.CheckpointManager(ckpt) as manager:
            assert manager.all_steps() == [1]
    restored = load(fmt, ckpt, targets, step=1)
    assert hex_bits(list(restored.values())) == json.loads((tmp_path / "expected.json").read_text())
    assert all(x.sharding.memory_kind == "pinned_host" for x in offloaded_leaves(restored["state"]))


def _rss(field: str) -> int:
    """`VmRSS` (resident now) or `VmHWM` (its peak) of this process, in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) * 1024


def saving_child(fmt: str, to_device_first: bool) -> dict[str, Any]:
    """Saves a 128 MiB offloaded state with `fmt` (or, the deliberate mistake, a save of
    `to_device(state)`); the peak RSS increase, the arrays with buffers of their own that
    JAX created (shape, memory kind) and the `jax.device_put` calls, during the save."""
    n = 1 << 24
    state = eqx_offload.offloaded(optax.adam(1e-3)).init({"w": jnp.zeros(n, jnp.float32)})
    jax.block_until_ready(state)
    puts: list[Any] = []
    original = jax.device_put
    before = {id(x) for x in jax.live_arrays()}
    created: list[Any] = []
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS
    base = _rss("VmHWM")
    jax.device_put = device_put_spy(puts)
    directory = tempfile.mkdtemp()
    saved = eqx_offload.to_device(state) if to_device_first else state
    if fmt == "eqx":
        eqx.tree_serialise_leaves(directory + "/state.eqx", saved)
    else:  # `orbax_async`: an asynchronous CheckpointManager, as training loops use it
        if fmt == "orbax":
            saver = ocp.StandardCheckpointer()
            saver.save(directory + "/state", saved)
        else:
            saver = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=True))
            saver.save(0, args=ocp.args.StandardSave(saved))
        created = [x for x in jax.live_arrays() if id(x) not in before]  # while writing
        saver.wait_until_finished()
        saver.close()
    jax.device_put = original
    created += [x for x in jax.live_arrays() if id(x) not in before]
    # A new `jax.Array` over a buffer of the state (orbax reads shards through
    # `shard.data`, a view) is no copy; only arrays with buffers of their own are.
    buffers = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)}
    copies = [x for x in created if x.is_deleted() or x.unsafe_buffer_pointer() not in buffers]
    return {"rss_increase": _rss("VmHWM") - base, "state_bytes": 2 * 4 * n, "device_puts": puts,
            "created": sorted({f"{tuple(x.shape)} {x.sharding.memory_kind}" for x in copies})}


@pytest.mark.slow
@pytest.mark.parametrize("fmt, to_device_first", [
    ("orbax", False), ("orbax_async", False), ("eqx", False), ("eqx", True)])
def test_saving_moves_nothing_and_does_not_double_host_memory(fmt: str,
                                                               to_device_first: bool) -> None:
    """No copy, no `device_put`, under a quarter of the state added to the peak RSS; the
    check can fail: a save of `to_device(state)` shows the copy."""
    result = call_isolated(saving_child, fmt, to_device_first)
    if to_device_first:
        assert f"({1 << 24},) device" in result["created"], result
        assert result["rss_increase"] >= result["state_bytes"] // 2, result
    else:
        assert result["created"] == [] and result["device_puts"] == [], result
        assert result["rss_increase"] < result["state_bytes"] // 4, result


def soak_child(steps: int, leak: bool) -> dict[str, Any]:
    """`steps` donated steps of an offloaded MLP (a 133 kB state); RSS and live arrays after
    warm-up and at the end. `leak`: the deliberate bug, one state copy per step kept alive."""
    model = eqx.nn.MLP(64, 64, 128, 1, key=jax.random.key(0))
    optimizer = eqx_offload.offloaded(optax.adamw(1e-3))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx_offload.filter_jit(donate="all")
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    x = jax.random.normal(jax.random.key(1), (8, 64))
    kept, marks = [], {}
    for i in range(steps):
        model, opt_state, loss = step(model, opt_state, x)
        if leak:
            kept.append(jax.tree.map(jnp.copy, opt_state))
        if i + 1 in (steps // 10, steps):  # after warm-up, at the end
            jax.block_until_ready(loss)
            gc.collect()
            when = "end" if i + 1 == steps else "warm"
            marks[f"rss_{when}"], marks[f"live_{when}"] = _rss("VmRSS"), len(jax.live_arrays())
    arrays = jax.tree.leaves(eqx.filter((model, opt_state), eqx.is_array))
    return {**marks, "state_bytes": sum(a.nbytes for a in jax.tree.leaves(opt_state)),
            "state_leaves": len(jax.tree.leaves(opt_state)), "steps": steps,
            "warm_up": steps // 10, "final_alive": all(not a.is_deleted() for a in arrays),
            "finite": bool(jnp.isfinite(loss))}


def _assert_no_leak(result: dict[str, Any]) -> None:
    """Flat: RSS grew by under a tenth of one state copy per step after warm-up."""
    grown = result["rss_end"] - result["rss_warm"]
    budget = (result["steps"] - result["warm_up"]) * result["state_bytes"] // 10
    assert grown < budget, (grown, budget, result)
    assert result["live_end"] == result["live_warm"], result


@pytest.mark.slow
@pytest.mark.parametrize("steps, leak", [(2000, False), (400, True)])
def test_soak_donated_steps(steps: int, leak: bool) -> None:
    """2,000 donated steps leak nothing; the check catches one state copy kept per step."""
    result = call_isolated(soak_child, steps, leak)
    if not leak:
        assert result["final_alive"] and result["finite"]
        _assert_no_leak(result)
        return
    with pytest.raises(AssertionError):
        _assert_no_leak(result)
    assert result["live_end"] - result["live_warm"] == (400 - 40) * result["state_leaves"]

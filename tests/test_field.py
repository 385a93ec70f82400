"""What fails in the field, made impossible or loud:

- XLA's pinned host pool on CUDA (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`): `init` and the
    restores check the bytes they place against its cap; `memory_report` shows it.
- Multi-device copies (jax-ml/jax#36308): every shard's data through `to_host`,
    `filter_shard` and the restores on a 4-device mesh, non-replicated (the canary:
    tests/upstream/test_upstream_multidevice_put.py; the update: test_equivalence.py).
- Saving an offloaded state (orbax, asynchronous too, and Equinox serialisation)
    moves nothing to the device and does not double host memory.
- A soak: 2,000 donated steps, host memory flat, no buffer left behind; the same check
    catches a loop that leaks one state copy per step.
"""

import gc
import re
import tempfile
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from isolated import result_of, run_isolated
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_offload
from eqx_offload import _checkpoint, _memory, _report


GiB = 1 << 30


# ---------------------------------------------------------------------------------------
# The pinned host pool


def test_host_pool_limit_reads_the_variable() -> None:
    variable = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
    assert _memory.host_pool_limit("gpu", {}) == 64 * GiB
    assert _memory.host_pool_limit("cuda", {variable: "192"}) == 192 * GiB
    assert _memory.host_pool_limit("gpu", {variable: "1.5"}) == 64 * GiB  # XLA reads an int
    assert _memory.host_pool_limit("cpu", {variable: "1"}) is None
    assert _memory.host_pool_limit("tpu", {}) is None


def test_check_host_pool_fails_naming_the_variable() -> None:
    _memory.check_host_pool(4 * GiB, "gpu", "offloaded(...).init", in_use=60 * GiB, limit=64 * GiB)
    with pytest.raises(eqx_offload.MemoryKindError) as info:
        _memory.check_host_pool(10 * GiB, "gpu", "offloaded(...).init", in_use=60 * GiB,
                                limit=64 * GiB)
    message = str(info.value)
    assert message.startswith("offloaded(...).init: placing 10.0 GiB in 'pinned_host'")
    assert "60.0 GiB already there" in message and "64.0 GiB cap" in message
    assert "export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=71" in message  # the fix
    # Off CUDA/ROCm there is no such pool: nothing to check.
    _memory.check_host_pool(10**15, "cpu", "offloaded(...).init")


@pytest.fixture
def small_pool(monkeypatch: pytest.MonkeyPatch) -> int:
    """The CPU treated as a CUDA backend whose pinned host pool holds 64 KiB."""
    cap = 64 << 10

    def limit(platform: str, environ: Any = None) -> int:
        return cap

    for module in (_memory, _checkpoint, _report):
        monkeypatch.setattr(module, "host_pool_limit", limit)
    # The pool is the process's: what earlier tests in this worker left in `pinned_host`
    # is not this test's (counted from here on).
    gc.collect()
    before = _memory.live_pooled_bytes
    baseline = before("cpu")

    def live(platform: str) -> int:
        return before(platform) - baseline

    monkeypatch.setattr(_memory, "live_pooled_bytes", live)
    return cap


def _sharded_params(mesh_size: int = 4) -> Any:
    mesh = jax.make_mesh((mesh_size,), ("x",), devices=jax.devices()[:mesh_size])
    return {"w": jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("x"))),
            "b": jax.device_put(jnp.ones(64), NamedSharding(mesh, P()))}


def test_init_and_restores_check_the_pool(small_pool: int) -> None:
    opt = eqx_offload.offloaded(optax.adam(1e-3))
    small = {"w": jnp.ones((32, 32))}  # 2 moments x 4 KiB: fits
    state = opt.init(small)
    big = {"w": jnp.ones((64, 128))}  # 2 moments x 32 KiB, with 8 KiB in use: does not
    before = {id(x) for x in jax.live_arrays()}
    with pytest.raises(eqx_offload.MemoryKindError,
                       match=r"offloaded\(\.\.\.\)\.init: placing 64\.0 KiB .* with 8\.0 KiB already there"):
        opt.init(big)
    placed = [x for x in jax.live_arrays() if id(x) not in before]
    assert not [x for x in placed if x.sharding.memory_kind == "pinned_host"], placed  # nothing placed
    with pytest.raises(eqx_offload.MemoryKindError, match=r"abstract_init\(\.\.\.\): placing"):
        eqx_offload.abstract_init(opt, big)
    with pytest.raises(eqx_offload.MemoryKindError, match=r"restore_target\(\.\.\.\): placing"):
        eqx_offload.restore_target(optax.adam(1e-3).init(big), eqx_offload.min_ndim(1))
    # `memory_report` shows the pool against its cap.
    report = eqx_offload.memory_report(state)
    assert report.host_pool_limit == small_pool and report.host_pool_bytes == 2 * 32 * 32 * 4
    assert str(report).splitlines()[-1] == (
        "pinned host pool: 8.0 KiB of the 64.0 KiB cap (12.5%; XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)")


def test_pool_bytes_count_each_devices_shard(small_pool: int) -> None:
    # A replicated leaf takes its full size on each device; a sharded one its shard.
    state = eqx_offload.offloaded(optax.adam(1e-3)).init(_sharded_params())
    report = eqx_offload.memory_report(state)
    assert report.host_pool_bytes == 2 * (64 * 64 * 4 + 4 * 64 * 4)


def test_no_pool_line_on_the_cpu() -> None:
    report = eqx_offload.memory_report(eqx_offload.to_host({"w": jnp.ones(4)}))
    assert report.host_pool_limit is None and "pinned host pool" not in str(report)
    assert report.host_pool_bytes == 16


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


MESHES = {
    "x": ((4,), ("x",), P("x")),
    "x_y": ((2, 2), ("x", "y"), P("x", "y")),
    "cols": ((2, 2), ("x", "y"), P(None, "y")),
}


def _mesh(name: str) -> tuple[jax.sharding.Mesh, P]:
    shape, names, spec = MESHES[name]
    devices = np.asarray(jax.devices()[4:8]).reshape(shape)  # not the default device
    return jax.sharding.Mesh(devices, names), spec


def _values() -> np.ndarray:
    return (np.arange(8 * 12, dtype=np.float32).reshape(8, 12) - 40.0) / 3.0


@pytest.mark.parametrize("layout", sorted(MESHES))
def test_to_host_and_back_keep_every_shard(layout: str) -> None:
    mesh, spec = _mesh(layout)
    values = _values()
    tree = {"a": jax.device_put(values, NamedSharding(mesh, spec)), "n": 3}
    host = eqx_offload.to_host(tree)
    assert host["a"].sharding.memory_kind == "pinned_host" and host["a"].sharding.spec == spec
    _expected_shards(host["a"], values)
    back = eqx_offload.to_device(host)
    assert back["a"].sharding.memory_kind == "device"
    _expected_shards(back["a"], values)


@pytest.mark.parametrize("layout", sorted(MESHES))
def test_filter_shard_keeps_every_shard(layout: str) -> None:
    # An offloaded state made on one device, resharded (not replicated) onto the mesh.
    mesh, spec = _mesh(layout)
    values = _values()
    opt = eqx_offload.offloaded(optax.sgd(1e-2, momentum=0.9))
    state = opt.init({"w": jnp.zeros((8, 12))})
    state = eqx_offload.OffloadedState(
        optax.TraceState(trace={"w": eqx_offload.to_host(jnp.asarray(values))}))
    sharded = eqx_offload.filter_shard(state, NamedSharding(mesh, spec))
    leaf = sharded.inner_state.trace["w"]
    assert leaf.sharding.memory_kind == "pinned_host" and leaf.sharding.spec == spec
    assert leaf.sharding.device_set == set(mesh.devices.flat)
    _expected_shards(leaf, values)
    # And back onto one device.
    single = eqx_offload.filter_shard(sharded, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    _expected_shards(single.inner_state.trace["w"], values)


def _sharded_run(layout: str) -> tuple[Any, Any, Any]:
    mesh, spec = _mesh(layout)
    params = {"w": jax.device_put(jnp.asarray(_values()), NamedSharding(mesh, spec))}
    opt = eqx_offload.offloaded(optax.adam(1e-2))
    state = opt.init(params)

    @eqx_offload.filter_jit(donate="all-except-first")
    def step(params, state):
        grads = jax.tree.map(lambda p: jnp.sin(p) * 0.5, params)
        updates, state = opt.update(grads, state, params)
        return state

    for _ in range(2):
        state = step(params, state)
    return opt, params, state


@pytest.mark.parametrize("fmt", ["orbax", "eqx"])
@pytest.mark.parametrize("layout", sorted(MESHES))
def test_restores_keep_every_shard(layout: str, fmt: str, tmp_path: Path) -> None:
    opt, params, state = _sharded_run(layout)
    target = eqx_offload.abstract_init(opt, params)
    if fmt == "orbax":
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp_path / "state", state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "state", target)
        checkpointer.close()
    else:
        eqx.tree_serialise_leaves(tmp_path / "state.eqx", state)
        restored = eqx.tree_deserialise_leaves(tmp_path / "state.eqx", target,
                                               filter_spec=eqx_offload.deserialise_filter_spec)
    assert _checksums(restored) == _checksums(state)
    for leaf in jtu.tree_leaves(restored):
        if leaf.ndim:
            assert leaf.sharding.spec == params["w"].sharding.spec
            assert leaf.sharding.memory_kind == "pinned_host"


# ---------------------------------------------------------------------------------------
# Saving moves nothing to the device and does not double host memory


def _peak_rss() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS


def saving_child(fmt: str, to_device_first: bool) -> dict[str, Any]:
    """Saves a 128 MiB offloaded state with `fmt`; returns the peak RSS increase during
    the save, the arrays with buffers of their own that JAX created during it (shape,
    memory kind) and the
    `jax.device_put` calls it made. `to_device_first`: the deliberate mistake, a save of
    `eqx_offload.to_device(state)` (what a save that brings the state back does)."""
    import orbax.checkpoint as ocp

    n = 1 << 24
    state = eqx_offload.offloaded(optax.adam(1e-3)).init({"w": jnp.zeros(n, jnp.float32)})
    jax.block_until_ready(state)
    puts: list[str] = []
    original = jax.device_put

    def spy(x: Any, device: Any = None, *args: Any, **kwargs: Any) -> Any:
        puts.append(str(getattr(device, "memory_kind", device)))
        return original(x, device, *args, **kwargs)

    before = {id(x) for x in jax.live_arrays()}
    created: list[Any] = []
    gc.collect()
    _reset_peak_rss()
    base = _peak_rss()
    jax.device_put = spy
    directory = tempfile.mkdtemp()
    saved = eqx_offload.to_device(state) if to_device_first else state
    if fmt == "eqx":
        eqx.tree_serialise_leaves(directory + "/state.eqx", saved)
    elif fmt == "orbax":
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(directory + "/state", saved)
        created = [x for x in jax.live_arrays() if id(x) not in before]
        checkpointer.wait_until_finished()
        checkpointer.close()
    else:  # an asynchronous CheckpointManager, as training loops use it
        manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=True))
        manager.save(0, args=ocp.args.StandardSave(saved))
        created = [x for x in jax.live_arrays() if id(x) not in before]  # while writing
        manager.wait_until_finished()
        manager.close()
    jax.device_put = original
    created += [x for x in jax.live_arrays() if id(x) not in before]
    # A new `jax.Array` over a buffer of the state (orbax reads shards through
    # `shard.data`, a view) is no copy; only arrays with buffers of their own are.
    buffers = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)}
    copies = [x for x in created if x.is_deleted() or x.unsafe_buffer_pointer() not in buffers]
    return {
        "rss_increase": _peak_rss() - base,
        "state_bytes": 2 * 4 * n,
        "created": sorted({f"{tuple(x.shape)} {x.sharding.memory_kind}" for x in copies}),
        "device_puts": puts,
    }


@pytest.mark.parametrize("fmt", ["orbax", "orbax_async", "eqx"])
def test_saving_moves_nothing_and_does_not_double_host_memory(fmt: str) -> None:
    result = result_of(run_isolated(saving_child, fmt, False))
    assert result["created"] == [] and result["device_puts"] == [], result
    # Measured: about 7 MiB for a 128 MiB state with orbax, 0 with Equinox.
    assert result["rss_increase"] < result["state_bytes"] // 4, result


def test_saving_check_catches_a_state_brought_to_the_device() -> None:
    # The check above can fail: the same save of `to_device(state)` shows the copy.
    result = result_of(run_isolated(saving_child, "eqx", True))
    assert f"({1 << 24},) device" in result["created"], result
    assert result["rss_increase"] >= result["state_bytes"] // 2, result


# ---------------------------------------------------------------------------------------
# A soak


def _current_rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def soak_child(steps: int, leak: bool) -> dict[str, Any]:
    """`steps` donated steps of an offloaded MLP (16.6k parameters, a 133 kB state); RSS and live
    arrays after warm-up and at the end. `leak`: the deliberate bug, one state copy per
    step kept alive."""
    model = eqx.nn.MLP(64, 64, 128, 1, key=jax.random.key(0))
    optimizer = eqx_offload.offloaded(optax.adamw(1e-3))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx_offload.filter_jit(donate="all")
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(
            lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    x = jax.random.normal(jax.random.key(1), (8, 64))
    kept = []
    warm_up = steps // 10
    marks = {}
    for i in range(steps):
        model, opt_state, loss = step(model, opt_state, x)
        if leak:
            kept.append(jax.tree.map(jnp.copy, opt_state))
        if i + 1 == warm_up:
            jax.block_until_ready(loss)
            gc.collect()
            marks["rss_warm"] = _current_rss()
            marks["live_warm"] = len(jax.live_arrays())
    jax.block_until_ready(loss)
    gc.collect()
    marks["rss_end"] = _current_rss()
    marks["live_end"] = len(jax.live_arrays())
    state_bytes = sum(a.nbytes for a in jax.tree.leaves(opt_state))
    alive = all(not a.is_deleted() for a in jax.tree.leaves(eqx.filter((model, opt_state), eqx.is_array)))
    return {**marks, "state_bytes": state_bytes, "state_leaves": len(jax.tree.leaves(opt_state)), "steps": steps, "warm_up": warm_up,
            "final_alive": alive, "finite": bool(jnp.isfinite(loss))}


def _assert_no_leak(result: dict[str, Any]) -> None:
    """A leak of one state copy per step after warm-up adds `(steps - warm_up) x
    state_bytes` (about 230 MiB over 2,000 steps here); flat means well under a tenth."""
    grown = result["rss_end"] - result["rss_warm"]
    budget = (result["steps"] - result["warm_up"]) * result["state_bytes"] // 10
    assert grown < budget, (grown, budget, result)
    assert result["live_end"] == result["live_warm"], result


def test_soak_2000_donated_steps() -> None:
    result = result_of(run_isolated(soak_child, 2000, False))
    assert result["final_alive"] and result["finite"]
    _assert_no_leak(result)


def test_soak_check_catches_one_state_copy_per_step() -> None:
    result = result_of(run_isolated(soak_child, 400, True))
    with pytest.raises(AssertionError):
        _assert_no_leak(result)
    # Exactly one state copy per step after warm-up is left behind.
    assert result["live_end"] - result["live_warm"] == (400 - 40) * result["state_leaves"]

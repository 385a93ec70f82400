"""`plan` for a TPU: a step compiled by libtpu for a v5e without one, its device peak and
host bytes read from XLA:TPU's memory analysis."""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import host_layer_stack, tpu_plan_marks
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_offload
from eqx_offload._core import compat
from eqx_offload._plan import tpu as _tpu
from eqx_offload.planner import plan, Plan, TPU_TARGETS, TpuTarget


pytestmark = [pytest.mark.both, *tpu_plan_marks()]  # (libtpu pins its JAX: both environments)

WIDTH, DEPTH, BATCH = 1024, 3, 8  # the state dominates
ADAMW = optax.adamw(1e-3)


def _model() -> eqx.nn.MLP:
    return eqx.nn.MLP(WIDTH, WIDTH, WIDTH, DEPTH, key=jax.random.key(0))


def _x() -> jax.Array:
    return jnp.ones((BATCH, WIDTH))


def _loss(model: Any, x: jax.Array) -> jax.Array:
    return jnp.mean(jax.vmap(model)(x).astype(jnp.float32) ** 2)


def _optax_step(opt: optax.GradientTransformation) -> tuple[Any, tuple[Any, ...]]:
    model = _model()
    state = opt.init(eqx.filter(model, eqx.is_array))

    def step(model: Any, state: Any, x: jax.Array) -> Any:
        grads = eqx.filter_grad(_loss)(model, x)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    return eqx_offload.filter_jit(step, donate="all"), (model, state, _x())


def _wrapped_step(wrapper: Any, model: Any) -> tuple[Any, tuple[Any, ...]]:
    """A step of `master_weights(...)` or `host_weights_optimizer(...)` (`update` returns the model)."""
    if isinstance(wrapper, eqx_offload.types.MasterWeights):
        model, state = wrapper.init(model)
    else:
        state = wrapper.init(model)

    def step(model: Any, state: Any, x: jax.Array) -> Any:
        return wrapper.update(eqx.filter_grad(_loss)(model, x), state, model)

    return eqx_offload.filter_jit(step, donate="all"), (model, state, _x())


def _host_bytes(tree: Any) -> int:
    """The bytes of `tree`'s array leaves in host memory."""
    return sum(x.nbytes for x in jax.tree.leaves(tree)
               if isinstance(x, jax.Array) and x.sharding.memory_kind == "pinned_host")


def _plan(made: tuple[Any, tuple[Any, ...]], target: Any = "v5e") -> Plan:
    step, args = made
    return plan(step, *args, target=target)


def test_offload_lowers_the_v5e_peak_and_the_host_holds_the_state() -> None:
    """The plain AdamW step holds the state on the device; `offloaded` holds it in host
    memory, moves each byte of it each way once and needs less device memory."""
    plain = _plan(_optax_step(ADAMW))
    state_step = _optax_step(eqx_offload.offloaded(ADAMW))
    state = _plan(state_step)
    on_host = _host_bytes(state_step[1][1])
    assert on_host > 0
    assert plain.host_bytes == 0 and plain.copies == ()
    assert state.host_bytes == on_host
    assert state.bytes_moved("to_device") == state.bytes_moved("to_host") == on_host
    assert state.device_peak_bytes < plain.device_peak_bytes
    assert plain.argument_bytes - state.argument_bytes == on_host


def test_master_weights_and_host_weights_keep_fp32_off_the_v5e() -> None:
    """Streamed master weights: the fp32 weights and both moments wait in host memory,
    the device holds the bf16 compute weights between steps, and the peak is below the
    plain step's (on a GPU by at least twice the fp32 weights, `test_models_plan.py`;
    XLA:TPU plans less of a drop, docs/gpu-plan.md). Weights in host memory
    (`host_weights`, `host_weights_optimizer`): the device holds none of them between steps (its
    peak, each layer's weights fetched where they are used, is not checked here)."""
    plain = _plan(_optax_step(ADAMW))
    fp32 = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(_model(), eqx.is_array)))
    streamed = functools.partial(eqx_offload.offloaded, group_bytes=0)
    master_step, (compute, mw_state, x) = _wrapped_step(
        eqx_offload.master_weights(ADAMW, offload=streamed), _model())
    master = plan(master_step, compute, mw_state, x.astype(jnp.bfloat16), target="v5e")
    assert master.host_bytes == _host_bytes(mw_state) >= 3 * fp32
    assert master.argument_bytes < fp32 // 2 + x.nbytes + fp32 // 10
    assert master.device_peak_bytes < plain.device_peak_bytes

    model = eqx.tree_at(lambda m: m.layers, _model(),
                        replace_fn=lambda ls: tuple(map(eqx_offload.host_weights, ls)))
    params_step, args = _wrapped_step(eqx_offload.host_weights_optimizer(ADAMW), model)
    params = plan(params_step, *args, target="v5e")
    # (Host bytes: the weights and the state, and host temporaries of the update.)
    assert params.host_bytes >= _host_bytes(args[:2]) >= 3 * fp32
    assert params.argument_bytes < x.nbytes + fp32 // 10


def test_a_copy_inside_a_loop_counts_once_per_trip() -> None:
    """Stacked layers in host memory, run forward by `scan_layers` without prefetch:
    XLA:TPU's loop fetches one layer per trip (an asynchronous `dynamic-slice-start`,
    with no trip count written in the HLO), so the step moves the whole stack once."""
    n, d = 6, 256
    layers, forward = host_layer_stack(n, d)

    planned = plan(forward, layers, jnp.ones((8, d)), target="v5e")
    (fetch,) = planned.copies_to("to_device")
    assert (fetch.count, fetch.nbytes) == (n, d * d * 4)
    assert planned.bytes_moved("to_device") == _host_bytes(layers) == planned.host_bytes
    assert planned.transfer_floor_seconds == pytest.approx(
        n * d * d * 4 / TPU_TARGETS["v5e"].host_link_bandwidth)


def test_target_by_name_or_object_and_what_the_plan_says() -> None:
    made = _optax_step(eqx_offload.offloaded(ADAMW))
    by_name, by_object = _plan(made, "v5e"), _plan(made, TPU_TARGETS["v5e"])
    assert by_name == by_object
    assert isinstance(by_name.chip, TpuTarget) and by_name.gpu is None
    assert by_name.target == "TPU v5 lite" and by_name.n_devices == 1
    assert by_name.device_memory_size == TPU_TARGETS["v5e"].device_memory_size
    assert by_name.host_limit_bytes is None and by_name.host_fits and by_name.fits
    assert by_name.compute_floor_seconds > 0 and by_name.transfer_floor_seconds > 0
    assert "compiled without a TPU" in by_name.summary()
    budget = _plan(made, TPU_TARGETS["v5e"].with_memory(by_name.device_peak_bytes - 1))
    assert not budget.fits and budget.device_peak_bytes == by_name.device_peak_bytes


def test_single_device_arguments_plan_as_on_a_one_device_mesh() -> None:
    """An argument on one device (`SingleDeviceSharding`, what `jax.device_put` gives)
    plans as the same argument on a one-device mesh: its memory kind is kept (a
    `SingleDeviceSharding` on a chip would lose it, `_tpu.on_chips`)."""
    step, (model, state, x) = _optax_step(eqx_offload.offloaded(ADAMW))
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))

    def on_mesh(a: Any) -> Any:
        if not isinstance(a, jax.Array):
            return a
        sharding = NamedSharding(mesh, P(), memory_kind=a.sharding.memory_kind)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    assert compat.is_single_device_sharding(jax.tree.leaves(state)[-1].sharding)
    single = plan(step, model, state, x, target="v5e")
    meshed = plan(step, *jax.tree.map(on_mesh, (model, state, x)), target="v5e")
    assert single == meshed
    assert single.host_bytes == _host_bytes(state)


def test_several_chips_plan_per_chip_with_their_collectives() -> None:
    """A step sharded over 4 of this process's CPU devices plans for 4 chips of a v5e
    topology: per-chip bytes, the collectives between them."""
    step, (model, state, x) = _optax_step(eqx_offload.offloaded(ADAMW))
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])

    def shard(a: Any, spec: Any) -> Any:
        if not isinstance(a, jax.Array):
            return a
        sharding = NamedSharding(mesh, spec, memory_kind=a.sharding.memory_kind)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    sharded = plan(step, jax.tree.map(lambda a: shard(a, P()), model),
                   jax.tree.map(lambda a: shard(a, P()), state), shard(x, P("data")),
                   target="v5e")
    one = plan(step, model, state, x, target="v5e")
    assert sharded.n_devices == 4
    assert sharded.host_bytes == one.host_bytes  # the state, replicated on each chip
    assert {c.kind for c in sharded.collectives} & {"all-reduce", "reduce-scatter"}


def test_unknown_target_names_the_known_ones() -> None:
    step, args = _optax_step(ADAMW)
    with pytest.raises(eqx_offload.errors.OptionError, match="'h100', 'h200', 'v5e', 'v5p', 'v6e'"):
        plan(step, *args, target="v4")


def test_without_libtpu_the_error_names_the_install(monkeypatch: Any) -> None:
    monkeypatch.setattr(_tpu.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(eqx_offload.errors.PlanError, match=r'pip install "jax\[tpu\]=='):
        plan(*(lambda s, a: (s, *a))(*_optax_step(ADAMW)), target="v5e")


def test_gpu_plan_is_plan_with_the_gpu_default() -> None:
    import inspect

    assert eqx_offload.planner.Plan is Plan and eqx_offload.plan is plan
    assert inspect.signature(eqx_offload.planner.gpu_plan).parameters["target"].default == "h200"
    assert inspect.signature(plan).parameters["target"].default is inspect.Parameter.empty

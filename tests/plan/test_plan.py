"""`gpu_plan` (XLA's plan for an H100/H200, compiled without a GPU) and what the `offloaded`
step must be in it, on MLPs where the state or the activations dominate the step's memory."""

import collections
import importlib.util
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload
from eqx_offload._plan import deviceless as _deviceless
from helpers import donated_step, gpu_plan_marks, Stacked


pytestmark = gpu_plan_marks()

MiB = 1 << 20
Workload = collections.namedtuple("Workload", "width depth batch")
STATE_HEAVY = Workload(2048, 8, 256)
ACTIVATION_HEAVY = Workload(1024, 4, 8192)
WORKLOADS = {"state": STATE_HEAVY, "activations": ACTIVATION_HEAVY}
MODES = {"default": {}, "whole": {"group_bytes": None}, "streamed": {"group_bytes": 4 * MiB},
         "host": {"compute": "host"}}
_PLANS: dict = {}


def _step(optimizer, workload):
    model = eqx.nn.MLP(workload.width, workload.width, workload.width, workload.depth,
                       key=jax.random.key(0))
    return donated_step(optimizer, model, jnp.ones((workload.batch, workload.width)))


def plan(mode, workload, **kwargs):
    """The plan of an AdamW step, plain or `offloaded` with `MODES[mode]`, cached."""
    key = (mode, workload, repr(sorted(kwargs.items())))
    if key not in _PLANS:
        adamw = optax.adamw(1e-3)
        optimizer = adamw if mode == "plain" else eqx_offload.offloaded(adamw, **MODES[mode])
        step, args = _step(optimizer, workload)
        _PLANS[key] = eqx_offload.planner.gpu_plan(step, *args, **kwargs)
    return _PLANS[key]


def state_bytes(workload):
    n = (workload.depth + 1) * (workload.width ** 2 + workload.width)
    return 2 * 4 * n  # Adam's mu and nu, float32


@pytest.mark.parametrize("workload", WORKLOADS)
def test_default_frees_the_state(workload):
    """The default step holds at most the plain step's peak minus 80% of the state."""
    workload = WORKLOADS[workload]
    plain, default = plan("plain", workload), plan("default", workload)
    moved = state_bytes(workload)
    assert default.host_bytes == pytest.approx(moved, rel=0.01)
    assert default.device_peak_bytes <= plain.device_peak_bytes - 0.8 * moved, (
        default.summary(), plain.summary())


@pytest.mark.parametrize("mode, workload", [
    *((mode, workload) for mode in ("default", "streamed", "whole") for workload in WORKLOADS),
    ("host", "activations")])
def test_never_more_than_plain(mode, workload):
    """No mode's peak is above the plain step's (host compute where its margin is least)."""
    offloaded, plain = plan(mode, WORKLOADS[workload]), plan("plain", WORKLOADS[workload])
    assert offloaded.device_peak_bytes <= plain.device_peak_bytes, (
        offloaded.summary(), plain.summary())


def test_whole_state_mode_brings_each_leaf_for_its_update():
    """`group_bytes=None` (XLA's older latency estimator): no state at the peak, no overlap."""
    plain, whole = plan("plain", STATE_HEAVY), plan("whole", STATE_HEAVY)
    assert whole.compiler_options == {"xla_gpu_enable_analytical_sol_latency_estimator": False}
    assert whole.device_peak_bytes < plain.device_peak_bytes - 0.5 * state_bytes(STATE_HEAVY)
    assert whole.host_bytes == pytest.approx(state_bytes(STATE_HEAVY), rel=0.01)
    assert whole.overlapped_fraction() == 0.0


def test_fits_where_plain_does_not():
    budget = 250 * MiB
    plain = plan("plain", STATE_HEAVY, device_memory=budget)
    default = plan("default", STATE_HEAVY, device_memory=budget)
    assert plain.device_memory_size == budget
    assert not plain.fits and default.fits, (plain.summary(), default.summary())


def test_copies_are_read_from_the_schedule():
    """Each state leaf crosses once each way; streamed, more copies overlap than whole."""
    default, whole = plan("default", STATE_HEAVY), plan("whole", STATE_HEAVY)
    n_leaves = 2 * 2 * (STATE_HEAVY.depth + 1)  # mu and nu of every weight and bias
    assert len(default.copies_to("to_device")) == n_leaves
    assert len(default.copies_to("to_host")) == n_leaves
    assert sum(c.nbytes for c in default.copies_to("to_device")) == state_bytes(STATE_HEAVY)
    assert plan("plain", STATE_HEAVY).copies == ()
    assert plan("plain", STATE_HEAVY).host_bytes == 0
    assert 0 < default.overlapped_fraction() < 1 or default.overlapped_fraction() == 1
    assert whole.overlapped_fraction("to_device") <= 2 / len(whole.copies_to("to_device"))
    assert default.overlapped_fraction("to_device") >= 0.4


def test_memory_budget_option_changes_the_plan():
    """`prefetch_options(device_bytes)` gives XLA's scheduler a budget the step fits in."""
    gpu = eqx_offload.planner.GPU_TARGETS["h200"].with_memory(600 * MiB)
    budget = 240 * MiB
    options = eqx_offload.stream.prefetch_options(budget, device_memory_size=gpu.device_memory_size)
    assert options == {"xla_gpu_memory_limit_slop_factor": 40}
    free = plan("plain", ACTIVATION_HEAVY, target=gpu)
    budgeted = plan("plain", ACTIVATION_HEAVY, target=gpu, compiler_options=options)
    assert budgeted.compiler_options == options
    assert free.device_peak_bytes > budget >= budgeted.device_peak_bytes
    assert eqx_offload.stream.prefetch_options() == {}


def test_the_same_step_is_compiled_once(monkeypatch):
    """The same module, options and GPU reuse an executable; any other compiles again."""
    compiled = []
    compile_ = _deviceless._compile
    monkeypatch.setattr(_deviceless, "_COMPILED", collections.OrderedDict())
    monkeypatch.setattr(_deviceless, "_compile", lambda *a: compiled.append(1) or compile_(*a))
    step, args = _step(optax.sgd(1e-3), Workload(8, 1, 3))
    first = eqx_offload.planner.gpu_plan(step, *args, target="h100")
    again = eqx_offload.planner.gpu_plan(step, *args, target="h100")
    assert len(compiled) == 1 and again == first
    eqx_offload.planner.gpu_plan(step, *args, target="h200")
    eqx_offload.planner.gpu_plan(step, *args, target="h100",
                         compiler_options={"xla_gpu_memory_limit_slop_factor": 50})
    other, other_args = _step(optax.sgd(1e-3), Workload(8, 1, 4))
    eqx_offload.planner.gpu_plan(other, *other_args, target="h100")
    assert len(compiled) == 4


def test_plain_function_and_host_pool(monkeypatch):
    """Any function is planned; host bytes meet the pinned pool's cap (whole GiB), or say it."""
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "0")
    state = eqx_offload.to_host({"w": jnp.ones((256, 256))})

    def double(tree):
        return jax.tree.map(lambda x: 2 * x, eqx_offload.to_device(tree))

    planned = eqx_offload.planner.gpu_plan(double, state)
    assert planned.host_limit_bytes == 0
    assert planned.host_bytes == 256 * 256 * 4 and not planned.host_fits
    assert len(planned.copies_to("to_device")) == 1
    assert "does NOT fit" in planned.summary()
    assert planned.run_settings() == ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=1"]
    assert "run with: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=1" in planned.summary()


def test_targets_errors_and_the_memory_jax_allocates(monkeypatch):
    """`fits` judges the share of the GPU JAX allocates (or a `device_memory`), and says the fix."""
    assert eqx_offload.planner.GPU_TARGETS["h100"].device_memory_size < eqx_offload.planner.GPU_TARGETS[
        "h200"].device_memory_size
    step, args = _step(optax.sgd(1e-3), Workload(8, 1, 2))
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    default = eqx_offload.planner.gpu_plan(step, *args, target="h100")
    assert default.target == "NVIDIA H100 80GB HBM3"
    assert "XLA's plan for NVIDIA H100" in default.summary()
    assert default.memory_fraction == 0.75 and default.fits and default.run_settings() == []
    assert default.usable_device_bytes == int(0.75 * default.device_memory_size)
    assert "75% of" in default.summary() and "run with" not in default.summary()
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "1e-9")
    tight = eqx_offload.planner.gpu_plan(step, *args, target="h100")
    assert tight.memory_fraction == 1e-9 and not tight.fits
    assert tight.device_peak_bytes == default.device_peak_bytes
    assert tight.run_settings() == ["XLA_CLIENT_MEM_FRACTION=0.01"]
    assert "run with: XLA_CLIENT_MEM_FRACTION=0.01" in tight.summary()
    given = eqx_offload.planner.gpu_plan(step, *args, target="h100", device_memory=1 << 30)
    assert given.memory_fraction == 1.0 and given.fits
    with pytest.raises(eqx_offload.errors.OptionError, match="target must be one of 'h100', 'h200'"):
        eqx_offload.planner.gpu_plan(step, *args, target="a100")
    with pytest.raises(eqx_offload.errors.OptionError, match="device_memory must be an int > 0"):
        eqx_offload.planner.gpu_plan(step, *args, device_memory=-1)


def test_stacked_layers_stream_by_layer():
    """One `(8, 512, 512)` stacked leaf streams a layer's rows at a time (its state's share
    of the peak is below the leaf; whole, above its two moments), each row once each way."""
    width, depth = 512, 8
    model = Stacked(width, depth, jax.random.key(0))

    def planned(optimizer):
        step, args = donated_step(optimizer, model, jnp.ones((256, width)))
        return eqx_offload.planner.gpu_plan(step, *args)

    plain = planned(optax.adamw(1e-3))
    default = planned(eqx_offload.offloaded(optax.adamw(1e-3)))
    whole = planned(eqx_offload.offloaded(optax.adamw(1e-3), group_bytes=None))
    leaf = depth * width * width * 4  # one moment of the stacked weight
    state = 2 * 4 * depth * (width * width + width)
    without_state = plain.device_peak_bytes - state
    assert default.device_peak_bytes - without_state < leaf, (default.summary(), plain.summary())
    assert whole.device_peak_bytes - without_state > 2 * leaf, whole.summary()
    assert default.host_bytes == whole.host_bytes == state
    for direction in ("to_device", "to_host"):
        copies = default.copies_to(direction)
        assert len(copies) == 2 * depth + 2  # mu and nu of each layer's weight, and of the biases
        assert sum(c.nbytes for c in copies) == state


@pytest.mark.parametrize("workload", WORKLOADS)
def test_default_copies_overlap_compute(workload):
    """90% of copies, all to the device, overlap compute (with `filter_jit`'s async limit)."""
    default = plan("default", WORKLOADS[workload])
    assert default.compiler_options["xla_gpu_experimental_parallel_async_compute_limit"] == 32
    assert default.overlapped_fraction() >= 0.9, default.summary()
    assert default.overlapped_fraction("to_device") == 1.0, default.summary()
    if workload == "activations":
        limited = plan("default", ACTIVATION_HEAVY, compiler_options={
            "xla_gpu_experimental_parallel_async_compute_limit": 2})
        assert limited.overlapped_fraction() < 0.8, limited.summary()


def test_good_usage_plans_from_shapes() -> None:
    """tests/types/good_usage.py's `plan_the_step`: planned from shapes, nothing allocated."""
    path = pathlib.Path(__file__).parents[1] / "types" / "good_usage.py"
    spec = importlib.util.spec_from_file_location("good_usage_plan", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Model(jax.random.key(0))
    assert module.plan_the_step(model, jnp.ones((8, 4)), jnp.ones((8, 2)))


def test_a_gradient_sum_made_in_the_backward_scan_plans_lower() -> None:
    """Four micro-batches' gradients of 8 stacked layers (8 MiB in fp32) summed in a donated
    carry: with `scan_layers(accumulate=...)` no second gradient buffer of the layers
    (the plan's peak at least 3/4 of their size lower), the same bytes moved (none)."""
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(512, 512, key=k))(
        jax.random.split(jax.random.key(0), 8))
    size = sum(a.nbytes for a in jax.tree.leaves(layers))

    def loss(layers, x, acc):
        def one(h):
            return eqx_offload.scan_layers(layers, h, lambda lay, h: jnp.tanh(lay(h)),
                                           accumulate=acc)
        return jnp.sum(jax.vmap(one)(x) ** 2)

    def plan_of(fused):
        @eqx_offload.filter_jit(donate="all-except-first")
        def step(layers, acc, xs):
            def micro(acc, x):
                if fused:
                    return jax.grad(loss)(layers, x, acc), None
                return jax.tree.map(jnp.add, acc, jax.grad(loss)(layers, x, None)), None
            return jax.lax.scan(micro, acc, xs)[0]
        return eqx_offload.planner.gpu_plan(step, layers, eqx.filter(layers, eqx.is_array),
                                    jnp.ones((4, 2, 512)), target="h100")

    unfused, fused = plan_of(False), plan_of(True)
    assert fused.device_peak_bytes <= unfused.device_peak_bytes - 3 * size // 4, (
        fused.summary(), unfused.summary())
    for direction in ("to_device", "to_host"):
        assert fused.bytes_moved(direction) == unfused.bytes_moved(direction)

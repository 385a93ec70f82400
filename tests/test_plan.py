"""`gpu_plan`: XLA's plan for an H100/H200, compiled on the CPU without a GPU, and the
properties the default `offloaded` step must have in it.

These need the GPU compiler (`jax-cuda12-plugin` at the installed JAX version and
`nvidia-cuda-nvcc-cu12`: the `plan` extra). scripts/check.sh installs it in the newest
environment and fails there before pytest if it is missing, so these tests cannot skip
in CI; elsewhere they skip with the install command.

The workloads are those of the issue: an MLP where the state dominates the step's
memory and one where the activations do. Every number is XLA's plan, not a measurement.
"""

import collections
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload
from eqx_offload import _deviceless
from helpers import donated_step, gpu_plan_marks, Stacked



pytestmark = gpu_plan_marks()


MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Workload:
    width: int
    depth: int
    batch: int


STATE_HEAVY = Workload(2048, 8, 256)
ACTIVATION_HEAVY = Workload(1024, 4, 8192)


def _step(optimizer, workload):
    model = eqx.nn.MLP(workload.width, workload.width, workload.width, workload.depth,
                       key=jax.random.key(0))
    return donated_step(optimizer, model, jnp.ones((workload.batch, workload.width)))


_PLANS: dict = {}


def plan(mode, workload, **kwargs):
    key = (mode, workload, repr(sorted(kwargs.items())))
    if key not in _PLANS:
        optimizer = {
            "plain": lambda: optax.adamw(1e-3),
            "default": lambda: eqx_offload.offloaded(optax.adamw(1e-3)),
            "whole": lambda: eqx_offload.offloaded(optax.adamw(1e-3), group_bytes=None),
            "streamed": lambda: eqx_offload.offloaded(optax.adamw(1e-3), group_bytes=4 * MiB),
            "host": lambda: eqx_offload.offloaded(optax.adamw(1e-3), compute="host"),
        }[mode]()
        step, args = _step(optimizer, workload)
        _PLANS[key] = eqx_offload.gpu_plan(step, *args, **kwargs)
    return _PLANS[key]


def state_bytes(workload):
    n = (workload.depth + 1) * (workload.width ** 2 + workload.width)
    return 2 * 4 * n  # Adam's mu and nu, float32


@pytest.mark.parametrize("workload", [STATE_HEAVY, ACTIVATION_HEAVY], ids=["state", "activations"])
def test_default_frees_the_state(workload):
    """The default step holds at most the plain step's peak minus 80% of the state."""
    plain, default = plan("plain", workload), plan("default", workload)
    moved = state_bytes(workload)
    assert default.host_bytes == pytest.approx(moved, rel=0.01)
    assert default.device_peak_bytes <= plain.device_peak_bytes - 0.8 * moved, (
        default.summary(), plain.summary())


@pytest.mark.parametrize("mode, workload", [
    *((mode, workload) for mode in ("default", "streamed", "whole")
      for workload in (STATE_HEAVY, ACTIVATION_HEAVY)),
    ("host", ACTIVATION_HEAVY),
], ids=["default-state", "default-activations", "streamed-state", "streamed-activations",
        "whole-state", "whole-activations", "host-activations"])
def test_never_more_than_plain(mode, workload):
    """Every mode, in XLA's plan. The whole state in one update (`group_bytes=None`)
    planned above the plain step on the activation-heavy MLP (4 MiB more here, 8 MiB
    on the benchmark's MLP) until `filter_jit` compiled it with XLA's older latency
    estimator. Host compute (never above it: the state stays on the host) is checked
    where its margin is smallest, the activation-heavy MLP (one compile)."""
    offloaded, plain = plan(mode, workload), plan("plain", workload)
    assert offloaded.device_peak_bytes <= plain.device_peak_bytes, (
        offloaded.summary(), plain.summary())


def test_whole_state_mode_brings_each_leaf_for_its_update():
    """`group_bytes=None` has no barriers; on a GPU `filter_jit` compiles it with XLA's
    older latency estimator (in the plan), under which, where the state dominates,
    each leaf comes to the device just before its update, after the backward pass:
    the state is not held at the peak (XLA's default estimator starts every copy
    before the forward pass and holds all of it, as much as the plain step), and no
    copy overlaps compute."""
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
    """Every state leaf crosses once each way; the plan loses nothing of the memory
    kinds (a plan that dropped `pinned_host` would have no copies and no host bytes)."""
    default = plan("default", STATE_HEAVY)
    n_leaves = 2 * 2 * (STATE_HEAVY.depth + 1)  # mu and nu of every weight and bias
    assert len(default.copies_to("to_device")) == n_leaves
    assert len(default.copies_to("to_host")) == n_leaves
    assert sum(c.nbytes for c in default.copies_to("to_device")) == state_bytes(STATE_HEAVY)
    assert plan("plain", STATE_HEAVY).copies == ()
    assert plan("plain", STATE_HEAVY).host_bytes == 0
    assert 0 < default.overlapped_fraction() < 1 or default.overlapped_fraction() == 1


def test_streamed_copies_overlap_more_than_whole_state():
    """The whole-state update's copies to the device run back to back before the first
    kernel; streamed, the copies of every group after the first overlap the update of
    the group before it or the backward pass."""
    whole = plan("whole", STATE_HEAVY)
    default = plan("default", STATE_HEAVY)
    assert whole.overlapped_fraction("to_device") <= 2 / len(whole.copies_to("to_device"))
    assert default.overlapped_fraction("to_device") >= 0.4


def test_memory_budget_option_changes_the_plan():
    """`prefetch_options(device_bytes)` hands XLA's scheduler a memory budget: the same
    step compiles into it, where without it XLA uses more."""
    gpu = eqx_offload.GPU_TARGETS["h200"].with_memory(600 * MiB)
    budget = 240 * MiB
    options = eqx_offload.prefetch_options(budget, device_memory_size=gpu.device_memory_size)
    assert options == {"xla_gpu_memory_limit_slop_factor": 40}
    free = plan("plain", ACTIVATION_HEAVY, target=gpu)
    budgeted = plan("plain", ACTIVATION_HEAVY, target=gpu, compiler_options=options)
    assert budgeted.compiler_options == options
    assert free.device_peak_bytes > budget >= budgeted.device_peak_bytes
    assert eqx_offload.prefetch_options() == {}


def test_targets_and_errors():
    assert eqx_offload.GPU_TARGETS["h100"].device_memory_size < eqx_offload.GPU_TARGETS[
        "h200"].device_memory_size
    step, args = _step(optax.sgd(1e-3), Workload(8, 1, 2))
    h100 = eqx_offload.gpu_plan(step, *args, target="h100")
    assert h100.target == "NVIDIA H100 80GB HBM3" and h100.fits
    assert "XLA's plan for NVIDIA H100" in h100.summary()
    with pytest.raises(eqx_offload.OptionError, match="target must be one of 'h100', 'h200'"):
        eqx_offload.gpu_plan(step, *args, target="a100")
    with pytest.raises(eqx_offload.OptionError, match="device_memory must be an int > 0"):
        eqx_offload.gpu_plan(step, *args, device_memory=-1)


def test_the_same_step_is_compiled_once(monkeypatch):
    """A plan of a module compiled before (same options, same GPUs) reuses its
    executable; other options, another GPU or another module compile again."""
    compiled = []
    compile_ = _deviceless._compile
    monkeypatch.setattr(_deviceless, "_COMPILED", collections.OrderedDict())
    monkeypatch.setattr(_deviceless, "_compile", lambda *a: compiled.append(1) or compile_(*a))
    step, args = _step(optax.sgd(1e-3), Workload(8, 1, 3))
    first = eqx_offload.gpu_plan(step, *args, target="h100")
    again = eqx_offload.gpu_plan(step, *args, target="h100")
    assert len(compiled) == 1 and again == first
    eqx_offload.gpu_plan(step, *args, target="h200")
    eqx_offload.gpu_plan(step, *args, target="h100",
                         compiler_options={"xla_gpu_memory_limit_slop_factor": 50})
    other, other_args = _step(optax.sgd(1e-3), Workload(8, 1, 4))
    eqx_offload.gpu_plan(other, *other_args, target="h100")
    assert len(compiled) == 4


def test_plain_function_and_host_pool(monkeypatch):
    """A function that is not a `filter_jit` one is planned as `filter_jit(fun)`; the
    host bytes are checked against the pinned pool's cap (read as XLA reads it: an
    integer number of GiB), and the summary gives the cap the run needs."""
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "0")
    state = eqx_offload.to_host({"w": jnp.ones((256, 256))})

    def double(tree):
        return jax.tree.map(lambda x: 2 * x, eqx_offload.to_device(tree))

    planned = eqx_offload.gpu_plan(double, state)
    assert planned.host_limit_bytes == 0
    assert planned.host_bytes == 256 * 256 * 4 and not planned.host_fits
    assert len(planned.copies_to("to_device")) == 1
    assert "does NOT fit" in planned.summary()
    assert planned.run_settings() == ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=1"]
    assert "run with: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=1" in planned.summary()


def test_fits_judges_the_memory_jax_allocates(monkeypatch):
    """`fits` compares the peak with the share of the GPU a JAX process allocates
    (XLA's default 0.75, or `XLA_CLIENT_MEM_FRACTION`); the summary and `run_settings`
    give the fraction the run needs. A `device_memory` given is taken whole."""
    step, args = _step(optax.sgd(1e-3), Workload(8, 1, 2))
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    default = eqx_offload.gpu_plan(step, *args, target="h100")
    assert default.memory_fraction == 0.75 and default.fits and default.run_settings() == []
    assert default.usable_device_bytes == int(0.75 * default.device_memory_size)
    assert "75% of" in default.summary() and "run with" not in default.summary()
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "1e-9")
    tight = eqx_offload.gpu_plan(step, *args, target="h100")
    assert tight.memory_fraction == 1e-9 and not tight.fits
    assert tight.device_peak_bytes == default.device_peak_bytes
    assert tight.run_settings() == ["XLA_CLIENT_MEM_FRACTION=0.01"]
    assert "run with: XLA_CLIENT_MEM_FRACTION=0.01" in tight.summary()
    given = eqx_offload.gpu_plan(step, *args, target="h100", device_memory=1 << 30)
    assert given.memory_fraction == 1.0 and given.fits


def test_stacked_layers_stream_by_layer():
    """A scanned stack of 8 layers built with `eqx.filter_vmap` has one `(8, 512, 512)`
    weight leaf for all of them. The default step streams its state a layer's rows at a
    time, so the state's share of the device peak (the peak less the plain step's peak
    without its state) is below one stacked leaf; brought whole (`group_bytes=None`,
    what the streamed default did before it could split a leaf), it is more than the
    leaf's two moments. Every row crosses once each way, straight into the leaf's host
    buffer (no host copy of it: the host bytes are the state's)."""
    width, depth = 512, 8
    model = Stacked(width, depth, jax.random.key(0))
    x = jnp.ones((256, width))

    def planned(optimizer):
        step, args = donated_step(optimizer, model, x)
        return eqx_offload.gpu_plan(step, *args)

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


@pytest.mark.parametrize("workload", [STATE_HEAVY, ACTIVATION_HEAVY], ids=["state", "activations"])
def test_default_copies_overlap_compute(workload):
    """At least 90% of the state's copies (both directions together) have a kernel under
    them in XLA's schedule, and every copy to the device does: the streamed update waits
    for each group's own gradients, and `filter_jit` lets XLA's scheduler keep more than
    two copies in flight (its option is in the plan). What is left are copies to host of
    the last group: nothing computes after the last update. The plans are those of the
    tests above (no compile of its own)."""
    default = plan("default", workload)
    assert default.compiler_options["xla_gpu_experimental_parallel_async_compute_limit"] == 32
    assert default.overlapped_fraction() >= 0.9, default.summary()
    assert default.overlapped_fraction("to_device") == 1.0, default.summary()
    # Without the option (XLA's default limit, 2) the same program overlaps far less.
    if workload == ACTIVATION_HEAVY:
        limited = plan("default", workload, compiler_options={
            "xla_gpu_experimental_parallel_async_compute_limit": 2})
        assert limited.overlapped_fraction() < 0.8, limited.summary()


def test_good_usage_plans_from_shapes() -> None:
    # tests/types/good_usage.py's plan_the_step (type-checked there): the model and the
    # state as `filter_eval_shape` gives them, planned; nothing of either allocated.
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent / "types" / "good_usage.py"
    spec = importlib.util.spec_from_file_location("good_usage_plan", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Model(jax.random.key(0))
    assert module.plan_the_step(model, jnp.ones((8, 4)), jnp.ones((8, 2)))

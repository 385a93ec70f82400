"""`filter_jit`: memory kinds of the outputs (host arrays assembled from shards retyped),
one compilation per configuration, the host-compute check, the GPU compiler options,
`jax.export`. (Donation: test_donation.py; plain `jax.jit`, `compute_on`: `tests/upstream/`.)"""

import re
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import jaxtyping
import numpy as np
import optax
import pytest
from donation_harness import mlp_setup, mlp_step, state_kinds
from helpers import assert_tree_equal, count_compiles, kind_list, tree_bits as bits
from mp_worker import make_step
from helpers import host_typed, make_layers, offloaded_leaves, scan_loss, SCAN_WIDTH as D, worker_opt, worker_params, worker_train

import eqx_offload
from eqx_offload._core.compat import host_compute


# Compile counts


@pytest.mark.parametrize("committed", [False, True])
def test_filter_jit_compiles_once(committed: bool) -> None:
    """Five calls of an offloaded-adamw step compile once, params committed or not."""
    model, opt, state, x = mlp_setup()  # (x outside the counted region: eager ops compile)
    params, static = eqx.partition(model, eqx.is_array)
    if committed:
        params = jax.device_put(params, jax.devices()[0])
        state = opt.init(params)
    assert all(leaf.committed == committed for leaf in jtu.tree_leaves(params))

    def step(params, state, x):
        model, state, loss = mlp_step(opt)(eqx.combine(params, static), state, x)
        return eqx.filter(model, eqx.is_array), state, loss

    jitted = eqx_offload.filter_jit(step)
    per_call = []
    for _ in range(5):
        with count_compiles() as compiles:
            params, state, _ = jitted(params, state, x)
        per_call.append(len(compiles))
        assert kind_list(state) == state_kinds(state)
    assert per_call == [1, 0, 0, 0, 0]


def test_a_call_inside_an_enclosing_trace_is_part_of_its_program() -> None:
    """Called with traced arguments (inside `jax.jit`, `jax.grad`, `jax.vmap`): a nested
    call of the enclosing program, as `eqx.filter_jit`'s, with the same results; the
    offloaded state it returns in host memory."""
    opt = eqx_offload.offloaded(optax.adam(0.1))
    params = {"w": jnp.arange(1.0, 5.0)}

    def step(params: Any, state: Any, scale: float) -> Any:
        updates, state = opt.update(jax.tree.map(lambda p: scale * p, params), state)
        return optax.apply_updates(params, updates), state

    ours, theirs = eqx_offload.filter_jit(step), eqx.filter_jit(step)
    state = opt.init(params)
    with count_compiles() as compiled:
        got = jax.jit(ours, static_argnums=2)(params, state, 2.0)
    assert len(compiled) == 1 and bits(got) == bits(jax.jit(theirs, static_argnums=2)(
        params, state, 2.0))
    assert kind_list(got[1].inner_state[0].mu) == ["pinned_host"]

    def loss(p: Any, jitted: Any) -> Any:
        return jnp.sum(jitted(p, state, 1.0)[0]["w"] ** 2)

    assert bits(jax.grad(loss)(params, ours)) == bits(jax.grad(loss)(params, theirs))
    batch = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), params)
    assert bits(jax.vmap(lambda p: ours(p, opt.init(p), 1.0)[0])(batch)) == bits(
        jax.vmap(lambda p: theirs(p, opt.init(p), 1.0)[0])(batch))


def test_cache_one_entry_per_configuration():
    @eqx_offload.filter_jit
    def f(x, n, *, scale):
        return jax.device_put(x, jax.memory.Space.Device) * n * scale, n

    ones, committed = jnp.ones(3), jax.device_put(jnp.ones(3), jax.devices()[0])
    assert not ones.committed and committed.committed
    with count_compiles() as compiles:
        out, n = f(ones, 2, scale=1.5)
        f(ones, 2, scale=1.5)
        f(committed, 2, scale=1.5)  # committed: same executable
        f(np.ones(3, np.float32), 2, scale=1.5)  # NumPy: same
    assert len(compiles) == 1
    assert n == 2 and isinstance(n, int)  # non-array outputs come back as they are
    assert_tree_equal(out, jnp.full(3, 3.0))
    inputs = jnp.ones(4), jnp.ones(3, jnp.int32), jax.device_put(jnp.ones(3), jax.memory.Space.Host)
    with count_compiles() as compiles:
        with pytest.warns(eqx_offload.errors.OffloadWarning, match="`n`"):
            f(ones, 3, scale=1.5)  # another static value (a Python number: warns)
        f(inputs[0], 2, scale=1.5)  # another shape
        f(inputs[1], 2, scale=1.5)  # another dtype
        f(inputs[2], 2, scale=1.5)  # another memory
    assert len(compiles) == 4


def test_a_changed_python_number_warns_once_naming_the_leaf_and_the_fix():
    """Linen's TrainState `step=0`, a static Python int, recompiles every step: one warning
    names the argument, the leaf and (first) the fix; the run is unchanged."""
    from ports import linen_trainstate

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = linen_trainstate.train(True, style="filter_jit")
    assert run.compiles == [1] * linen_trainstate.STEPS
    messages = [str(w.message) for w in caught]
    assert [w.category for w in caught] == [eqx_offload.errors.OffloadWarning], messages
    message = messages[0]
    assert "`state`, leaf .step" in message and "(0 -> 1)" in message
    assert message.index("jnp.asarray") < message.index("eqx_offload.jit") < message.index(".step")
    assert len(message.split()) <= 80


def test_unchanged_or_boolean_static_leaves_do_not_warn():
    """A static float that keeps its value, a bool flag that flips: no warning."""
    @eqx_offload.filter_jit
    def f(x, config, training):
        return x * config["scale"] if training else x

    xs = [jnp.full(3, float(i)) for i in range(4)]
    with warnings.catch_warnings(record=True) as caught, count_compiles("f") as compiles:
        warnings.simplefilter("always")
        for i, x in enumerate(xs):
            f(x, {"scale": 0.5}, training=i % 2 == 0)
    assert len(compiles) == 2
    assert caught == []


def test_filter_jit_decorator_forms_and_bad_donate():
    @eqx_offload.filter_jit(donate="none")
    def g(x):
        return x + 1

    assert_tree_equal(g(jnp.zeros(2)), jnp.ones(2))
    assert_tree_equal(eqx_offload.filter_jit(lambda x: x - 1)(jnp.ones(2)), jnp.zeros(2))
    # (The suite's runtime type checks catch it first, at the `Literal` annotation.)
    with pytest.raises(jaxtyping.TypeCheckError, match="donate"):
        eqx_offload.filter_jit(lambda x: x, donate="some")  # type: ignore[arg-type]  # the wrong value under test


def test_output_memory_kinds_follow_the_program():
    @eqx_offload.filter_jit
    def f(x, y):
        return jax.device_put(x, jax.memory.Space.Host), jax.device_put(y, jax.memory.Space.Device)

    host = jax.device_put(jnp.ones(3), jax.memory.Space.Host)
    a, b = f(jnp.ones(3), host)
    assert a.sharding.memory_kind == "pinned_host"
    assert b.sharding.memory_kind == "device"


def test_filter_jit_retypes_host_arrays_assembled_from_shards() -> None:
    """Shards assembled as orbax does are typed device memory (JAX 0.10): `filter_jit`
    retypes them without a warning, bitwise, donation honoured."""
    opt = worker_opt()
    step, params = make_step(opt), worker_params()
    state = opt.init(params)

    def assembled(leaf: jax.Array) -> jax.Array:
        value = np.asarray(leaf)
        return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index: value[index])

    rebuilt = jax.tree.map(assembled, state)
    assert all(x.sharding.memory_kind == "pinned_host" and not host_typed(x)
               for x in offloaded_leaves(rebuilt))
    assert bits(rebuilt) == bits(state)
    new = worker_train(jax.tree.map(jnp.copy, params), rebuilt, step, range(1))
    assert all(x.is_deleted() for x in jtu.tree_leaves(rebuilt))
    assert bits(new) == bits(worker_train(params, state, step, range(1)))
    assert all(host_typed(x) for x in offloaded_leaves(new[1]))


# Compute on host-resident values


def test_host_compute_is_rejected_but_fetching_a_host_slice_is_not() -> None:
    """Computing on a host value fails before compiling, naming the op and aval; fetching
    a host slice to the device (and computing there) passes."""
    host = jax.device_put(jnp.ones(3), jax.memory.Space.Host)
    with pytest.raises(eqx_offload.errors.CompositionError, match=r"`mul` on float32<host>\[3\]"):
        with count_compiles() as compiles:
            eqx_offload.filter_jit(lambda x: x * 2)(host)
    assert len(compiles) == 0
    stacked = jax.device_put(jnp.arange(12.0).reshape(4, 3), jax.memory.Space.Host)

    def fetch(a: jax.Array, i: jax.Array) -> jax.Array:
        return jax.device_put(jax.lax.dynamic_slice(a, (i, 0), (1, 3)), jax.memory.Space.Device)[0] * 2

    out = eqx_offload.filter_jit(fetch)(stacked, jnp.int32(2))
    assert_tree_equal(out, jnp.arange(6.0, 9.0) * 2)
    with pytest.raises(eqx_offload.errors.CompositionError, match="computes on host-resident"):
        eqx_offload.filter_jit(lambda a, i: jax.lax.dynamic_slice(a, (i, 0), (1, 3)) * 2)(
            stacked, jnp.int32(2))


def test_computing_on_host_model_weights_names_host_weights_and_the_leaf() -> None:
    """A model moved with `to_host` and called in the step: the fix first (`host_weights`,
    `scan_layers`), then the argument and the weight's path; a host optimizer state read
    in the step keeps the state's message."""
    model = eqx_offload.to_host(eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0)))
    with pytest.raises(eqx_offload.errors.CompositionError) as caught:
        eqx_offload.filter_jit(lambda model, x: model(x))(model, jnp.ones(3))
    lines = str(caught.value).splitlines()
    assert len(lines) <= 4 and lines[0].startswith("Keep model weights in host memory with "
                                                   "`eqx_offload.host_weights(module)`")
    assert "`eqx_offload.scan_layers`" in lines[0] and lines[-1].startswith("See https://")
    assert "args[0], leaf .layers[0].weight (not an optimizer state)" in lines[1]
    state = eqx_offload.offloaded(optax.adam(0.1)).init({"w": jnp.ones(3)})
    with pytest.raises(eqx_offload.errors.CompositionError, match="^Bring what the step reads"):
        eqx_offload.filter_jit(lambda s: s.inner_state[0].mu["w"] * 2)(state)


def test_computing_on_a_host_weights_gradient_names_it_and_to_device() -> None:
    """A micro-batch sum that adds a host weight's gradient (in host memory) as it is:
    the error names the variable and `to_device`, not the weight it came from; the same
    sum with `to_device` runs, bitwise the sum of device gradients."""
    model = eqx_offload.to_host(eqx.nn.Linear(3, 3, key=jax.random.key(0)))
    xs = jnp.arange(12.0).reshape(4, 3)

    def summed(model: Any, bring: Any) -> Any:
        def micro(acc: Any, x: jax.Array) -> Any:
            grads = eqx.filter_grad(lambda m: jnp.sum(eqx_offload.to_device(m)(x) ** 2))(model)
            return jax.tree.map(lambda a, g: a + bring(g), acc, grads), None
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), eqx.filter(model, eqx.is_array))
        return jax.lax.scan(micro, zeros, xs)[0]

    with pytest.raises(eqx_offload.errors.CompositionError) as caught:
        eqx_offload.filter_jit(summed)(model, lambda g: g)
    lines = str(caught.value).splitlines()
    assert len(lines) == 3 and lines[0].startswith(
        "Bring `g` to the device before computing on it: `eqx_offload.to_device(g)`")
    assert "computes on `g`, made in the step" in lines[1] and ".weight" not in lines[1]
    got = eqx_offload.filter_jit(summed)(model, eqx_offload.to_device)
    want = eqx_offload.filter_jit(summed)(eqx_offload.to_device(model), lambda g: g)
    assert_tree_equal(got, want)
    assert set(kind_list(got)) == {"device"}


def test_host_compute_under_compute_on_is_allowed():
    """The function form of `compute_on` (`compute_on2` in JAX 0.10)."""
    to_host = jax.memory.Space.Host
    double = host_compute(compute_type="device_host", out_memory_spaces=to_host)(lambda x: x * 2)
    host = jax.device_put(jnp.arange(3.0), to_host)
    out = eqx_offload.filter_jit(double)(host)
    assert out.sharding.memory_kind == "pinned_host"
    assert_tree_equal(jax.device_put(out, jax.memory.Space.Device), jnp.arange(3.0) * 2)


def test_scan_over_steps_with_host_state():
    """Carrying the host state through `lax.scan` (several steps in one program) only moves
    it: accepted, and equal to the same scan without offload."""

    def run(offload: bool) -> Any:
        model, opt, state, x = mlp_setup(offload)
        params, static = eqx.partition(model, eqx.is_array)
        step = mlp_step(opt)

        def body(carry, x):
            params, state = carry
            model, state, loss = step(eqx.combine(params, static), state, x)
            return (eqx.filter(model, eqx.is_array), state), loss

        xs = jnp.stack([x * i for i in range(1, 4)])
        return eqx_offload.filter_jit(lambda p, s: jax.lax.scan(body, (p, s), xs))(params, state)

    (p_off, s_off), losses_off = run(True)
    (p_ref, s_ref), losses_ref = run(False)
    assert_tree_equal(losses_off, losses_ref)
    assert_tree_equal(p_off, p_ref)
    assert_tree_equal(s_off.inner_state, s_ref)
    assert kind_list(s_off) == state_kinds(s_off)


def _adam_setup(**options: Any) -> tuple[Any, Any, Any]:
    """Params, an offloaded adam's state, and a step with that adam."""
    params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    opt = eqx_offload.offloaded(optax.adam(1e-3), **options)

    def step(params, state):
        updates, state = opt.update(params, state, params)
        return optax.apply_updates(params, updates), state

    return params, opt.init(params), step


def test_default_compiler_options_only_for_an_accelerator_step_that_streams():
    """GPU scheduler options for a streamed update, others for a whole host state in one
    update (streamed wins); a TPU's for a streamed update alone; none on the CPU, whose
    program is unchanged."""
    from eqx_offload._jit.stage import (default_compiler_options, GPU_STREAMED_OPTIONS,
                                               GPU_WHOLE_STATE_OPTIONS, TPU_STREAMED_OPTIONS)

    assert default_compiler_options("tpu", True) == TPU_STREAMED_OPTIONS
    assert default_compiler_options("tpu", False, whole=True) == {}
    assert default_compiler_options("tpu", False, prefetched=True) == {}
    assert default_compiler_options("cpu", True) == {}
    assert default_compiler_options("cpu", False, whole=True) == {}
    assert default_compiler_options("cuda", False) == {}
    for platform in ("cuda", "gpu", "rocm"):
        assert default_compiler_options(platform, True) == GPU_STREAMED_OPTIONS
        assert default_compiler_options(platform, True, whole=True) == GPU_STREAMED_OPTIONS
        assert default_compiler_options(platform, False, whole=True) == GPU_WHOLE_STATE_OPTIONS
    assert GPU_STREAMED_OPTIONS["xla_gpu_experimental_parallel_async_compute_limit"] > 2
    assert GPU_WHOLE_STATE_OPTIONS == {"xla_gpu_enable_analytical_sol_latency_estimator": False}

    def lowered_for_gpu(**options):
        params, state, step = _adam_setup(**options)
        step = eqx_offload.filter_jit(step, donate="all-except-first")
        return step.lower_for(("cuda",), (params, state), {}), step, params, state

    default, step, params, state = lowered_for_gpu()
    assert default.compiler_options == GPU_STREAMED_OPTIONS
    assert lowered_for_gpu(group_bytes=0)[0].compiler_options == GPU_STREAMED_OPTIONS
    assert lowered_for_gpu(group_bytes=None)[0].compiler_options == GPU_WHOLE_STATE_OPTIONS
    # Nothing in host memory (`where=False`): nothing to order, XLA's defaults.
    assert lowered_for_gpu(group_bytes=None, where=False)[0].compiler_options == {}
    # On this machine's CPU: none, and the step runs as before.
    assert step.lower(params, state).compiler_options == {}
    _, state = step(params, state)
    assert kind_list(state) == ["device"] + ["pinned_host"] * 4


def test_filter_jit_raises_the_copy_limit_for_a_prefetching_step_on_a_gpu() -> None:
    """Only a prefetching host-weight GPU step raises the async copy limit."""
    from eqx_offload._jit.stage import GPU_PREFETCHED_OPTIONS

    def defaults(layers: Any, prefetch: bool, platform: str = "cuda") -> dict[str, Any]:
        step = eqx_offload.filter_jit(jax.grad(lambda s, x: scan_loss(s, x, prefetch=prefetch)))
        return step.lower_for((platform,), (layers, jnp.ones(D)), {}).compiler_options

    on_host = eqx_offload.to_host(make_layers())
    assert defaults(on_host, True) == GPU_PREFETCHED_OPTIONS == {
        "xla_gpu_experimental_parallel_async_compute_limit": 32}
    assert defaults(on_host, False) == defaults(make_layers(), True) == {}
    assert defaults(on_host, True, "cpu") == {}


# `jax.export`


@pytest.mark.parametrize("donate, options", [
    ("none", {}), ("all", {}), ("none", {"group_bytes": 0}), ("none", {"compute": "host"})])
def test_export_keeps_memory_kinds_and_copies_for_cuda(donate: str, options: dict) -> None:
    """Streamed and host-compute steps too (without a warning)."""
    params, state, step = _adam_setup(**options)
    exported = eqx_offload.filter_jit(step, donate=donate).export(platforms=["cuda"])(params, state)
    text = exported.mlir_module()
    assert exported.platforms == ("cuda",)
    kinds = re.findall(r'mhlo.memory_kind = "(\w+)"', text)
    assert kinds.count("pinned_host") == 8  # 4 state inputs, 4 state outputs
    assert np.ndim(state.inner_state[0].count) == 0
    if not options:  # each of the 4 offloaded leaves: one copy to the device, one back
        assert text.count("annotate_device_placement") >= 8


def test_export_runs_bitwise_on_this_backend() -> None:
    params, state, step = _adam_setup()
    jitted = eqx_offload.filter_jit(step)
    exported = jitted.export()(params, state)
    out = exported.call(*jax.tree.leaves((params, state)))
    ref = jax.tree.leaves(jitted(params, state))
    assert_tree_equal(list(out), ref)
    assert [x.sharding.memory_kind for x in out] == [x.sharding.memory_kind for x in ref]
    assert {x.sharding.memory_kind for x in out if x.ndim} >= {"pinned_host"}


def test_export_runs_the_step_once_and_keeps_weak_types() -> None:
    """`export`'s specs drop a leaf's weak type, so JAX's trace cache lacks the staged
    trace: the program traced first is replayed, not the step run again with a strongly
    typed `lr` (which would make the result float32)."""
    calls = []

    def scale(x: jax.Array, lr: jax.Array) -> jax.Array:
        calls.append(1)
        return x * lr

    x, lr = jnp.ones(3, jnp.bfloat16), jnp.asarray(0.5)
    assert lr.weak_type
    exported = eqx_offload.filter_jit(scale).export()(x, lr)
    assert len(calls) == 1
    assert [a.dtype for a in exported.out_avals] == [jnp.bfloat16]


def test_export_of_plain_jit_with_specs_is_loud() -> None:
    """Specs from the arrays' shardings, `jax.jit`: no copies; `offloaded` names the fix."""
    params, state, step = _adam_setup()
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                         (params, state))
    with pytest.warns(eqx_offload.errors.OffloadWarning, match=r"filter_jit\(step\)\.export") as record:
        exported = jax.export.export(jax.jit(step), platforms=["cuda"])(*specs)
    assert "traced without the state's memory kinds" in str(record[0].message)
    ported = eqx_offload.filter_jit(step).export(platforms=["cuda"])(params, state)
    assert (exported.mlir_module().count("annotate_device_placement")
            < ported.mlir_module().count("annotate_device_placement"))

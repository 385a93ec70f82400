"""`filter_jit`: donation of host-resident state, memory kinds of the outputs (host arrays
assembled from shards retyped), one compilation per configuration, the host-compute
check, the GPU compiler options, `jax.export`. (A failed call and shared buffers:
test_donation.py. How plain `jax.jit` compiles the same step, and which forms of
`compute_on` JAX offers, are upstream behaviour: `tests/upstream/`.)"""

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
from helpers import assert_tree_equal, count_compiles, hex_bits, kind_list, tree_bits as bits
from isolated import call_isolated
from test_checkpoint import host_typed, make_opt, make_params, make_step, offloaded_leaves, train
from test_scan import D, make_layers, scan_loss

import eqx_offload
from eqx_offload._compat import host_compute


# ---------------------------------------------------------------------------------------
# Helpers


def _model() -> eqx.nn.MLP:
    # Shapes: weights (8, 3), (8, 8), (2, 8); biases (8,), (8,), (2,). The batch (4, 3)
    # has a shape no parameter or state leaf has, so it is the only input that a
    # donation can leave unused.
    return eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))


def _batch() -> jax.Array:
    return jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)


def _loss(model: eqx.nn.MLP, x: jax.Array) -> jax.Array:
    return jnp.sum(jax.vmap(model)(x) ** 2)


def _make_step(opt: optax.GradientTransformation, order: str = "model_state"):
    def step(model, state, x):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return (model, state, loss) if order == "model_state" else (state, model, loss)

    return step


def _unpack(out: tuple, order: str) -> tuple:
    return out if order == "model_state" else (out[1], out[0], out[2])


def _expected_state_kinds(state: Any) -> list[str]:
    # `offloaded`'s default `where`: every array but 0-d scalars is in host memory.
    return ["pinned_host" if x.ndim >= 1 else "device" for x in jtu.tree_leaves(state)]


def _unusable(messages: list[str]) -> set[str]:
    """The avals JAX lists in its "Some donated buffers were not usable" warnings."""
    found: set[str] = set()
    for message in messages:
        match = re.search(r"Some donated buffers were not usable: (.*?)\.\n", message)
        assert match is not None, message
        found.update(a.strip() for a in re.split(r",\s*(?![^\[]*\])", match.group(1)))
    return found


# ---------------------------------------------------------------------------------------
# Donation (in a subprocess: a regression would abort the process)


STEPS = 3
DONATION_CONFIGS = [
    (donate, order)
    for donate in ("all", "all-except-first", "warn", "warn-except-first")
    for order in ("model_state", "state_model")
] + [("state-only", "model_state"), ("state-only-warn", "model_state")]


def donation_child() -> dict[str, Any]:
    """For every configuration: run `STEPS` donating steps of an offloaded-adamw
    training loop and report what happened (runs in a fresh process)."""
    results: dict[str, Any] = {}
    # The reference: no offload, no donation.
    model, opt = _model(), optax.adamw(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))
    step = eqx.filter_jit(_make_step(opt))
    losses = []
    for _ in range(STEPS):
        model, state, loss = step(model, state, _batch())
        losses.append(hex_bits(loss))
    results["reference"] = {"losses": losses, "model": hex_bits(model), "state": hex_bits(state)}

    for donate, order in DONATION_CONFIGS:
        model, opt = _model(), eqx_offload.offloaded(optax.adamw(1e-2))
        state = opt.init(eqx.filter(model, eqx.is_array))
        x = _batch()
        if donate.startswith("state-only"):
            # The state is the only donated argument: the batch is closed over.
            inner = _make_step(opt, order)
            mode = "warn-except-first" if donate.endswith("warn") else "all-except-first"
            step = eqx_offload.filter_jit(lambda m, s: inner(m, s, x), donate=mode)
            call = step
        else:
            step = eqx_offload.filter_jit(_make_step(opt, order), donate=donate)
            call = lambda m, s: step(m, s, x)  # noqa: E731
        messages, losses, deleted_state, deleted_model = [], [], [], []
        with count_compiles() as compiles, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(STEPS):
                old_model, old_state = model, state
                model, state, loss = _unpack(call(model, state), order)
                deleted_state.append([x.is_deleted() for x in jtu.tree_leaves(old_state)])
                deleted_model.append([
                    x.is_deleted() for x in jtu.tree_leaves(eqx.filter(old_model, eqx.is_array))
                ])
                losses.append(hex_bits(loss))
                assert kind_list(model) == ["device"] * len(kind_list(model))
                assert kind_list(state) == _expected_state_kinds(state), kind_list(state)
        messages = [str(w.message) for w in caught]
        results[f"{donate}/{order}"] = {
            "losses": losses,
            "model": hex_bits(model),
            "state": hex_bits(state.inner_state),
            "deleted_state": deleted_state,
            "deleted_model": deleted_model,
            "warnings": messages,
            "compiles": len(compiles),
            "state_avals": sorted({
                f"{x.dtype}[{','.join(map(str, x.shape))}]" for x in jtu.tree_leaves(state)
            }),
        }
    return results


def _donation_failures(result: dict[str, Any], reference: dict[str, Any], donate: str) -> list[str]:
    failures = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    # Equal results to the loop without offload or donation, bit for bit.
    check(result["losses"] == reference["losses"], "losses differ from the reference")
    check(result["model"] == reference["model"], "params differ from the reference")
    check(result["state"] == reference["state"], "state differs from the reference")
    # Donated inputs are really reused: every state leaf (host moments and the device
    # count) is deleted after each call; the model only where the first argument is
    # donated.
    check(all(all(step) for step in result["deleted_state"]),
          f"donated state leaves not deleted: {result['deleted_state']}")
    model_donated = donate in ("all", "warn")
    check(all(all(step) == model_donated and any(step) == model_donated
              for step in result["deleted_model"]),
          f"model leaves deleted: {result['deleted_model']}, donated: {model_donated}")
    # No "donated buffers were not usable" for any state leaf: in the `warn` modes the
    # only unusable buffer is the batch, which no output matches; the other modes
    # silence the warning (and donating only the state leaves nothing unusable).
    if donate in ("warn", "warn-except-first"):
        unusable = _unusable(result["warnings"])
        check(unusable == {"float32[4,3]"}, f"unusable donations: {unusable}")
        check(not set(result["state_avals"]) & unusable, f"state leaves unusable: {unusable}")
    else:
        check(result["warnings"] == [], f"warnings: {result['warnings']}")
    # One compilation for all the steps (the first call's params are uncommitted).
    check(result["compiles"] == 1, f"{result['compiles']} compilations")
    return failures


@pytest.mark.slow
def test_donation():
    # Every configuration in one fresh process (a regression would abort it): donating
    # the state only, "all", "all-except-first" and the "warn" modes, with outputs
    # `(model, state)` and `(state, model)`.
    results = call_isolated(donation_child)
    failures = {}
    for donate, order in DONATION_CONFIGS:
        found = _donation_failures(results[f"{donate}/{order}"], results["reference"], donate)
        if found:
            failures[f"{donate}/{order}"] = found
    assert not failures, failures
    assert len(results) == len(DONATION_CONFIGS) + 1


# ---------------------------------------------------------------------------------------
# Compile counts


def _offloaded_loop(jit, params_committed: bool, steps: int = 5) -> list[int]:
    """Compilations per call of `steps` calls of a jitted offloaded-adamw step."""
    params, static = eqx.partition(_model(), eqx.is_array)
    if params_committed:
        params = jax.device_put(params, jax.devices()[0])
    opt = eqx_offload.offloaded(optax.adamw(1e-2))
    state = opt.init(params)
    x = _batch()  # (made outside the counted region: eager ops compile too)
    assert all(leaf.committed == params_committed for leaf in jtu.tree_leaves(params))

    def step(params, state, x):
        model, state, loss = _make_step(opt)(eqx.combine(params, static), state, x)
        return eqx.filter(model, eqx.is_array), state, loss

    jitted = jit(step)
    per_call = []
    for _ in range(steps):
        with count_compiles() as compiles:
            params, state, _ = jitted(params, state, x)
        per_call.append(len(compiles))
        assert kind_list(state) == _expected_state_kinds(state)
    return per_call


def test_filter_jit_compiles_once_with_uncommitted_params():
    assert not jtu.tree_leaves(eqx.filter(_model(), eqx.is_array))[0].committed
    assert _offloaded_loop(eqx_offload.filter_jit, params_committed=False) == [1, 0, 0, 0, 0]


def test_filter_jit_compiles_once_with_committed_params():
    assert _offloaded_loop(eqx_offload.filter_jit, params_committed=True) == [1, 0, 0, 0, 0]


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
        with pytest.warns(eqx_offload.OffloadWarning, match="`n`"):
            f(ones, 3, scale=1.5)  # another static value (a Python number: warns)
        f(inputs[0], 2, scale=1.5)  # another shape
        f(inputs[1], 2, scale=1.5)  # another dtype
        f(inputs[2], 2, scale=1.5)  # another memory
    assert len(compiles) == 4


def test_a_changed_python_number_warns_once_naming_the_leaf_and_the_fix():
    # Flax linen's TrainState holds `step=0`, a Python int: static under filter_jit, so
    # every step compiles again. It says so once, naming the argument, the leaf, and
    # the fix first; the run itself is unchanged.
    from ports import linen_trainstate

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = linen_trainstate.train(True, style="filter_jit")
    assert run.compiles == [1] * linen_trainstate.STEPS
    messages = [str(w.message) for w in caught]
    assert [w.category for w in caught] == [eqx_offload.OffloadWarning], messages
    message = messages[0]
    assert "`state`, leaf .step" in message and "(0 -> 1)" in message
    assert message.index("jnp.asarray") < message.index("eqx_offload.jit") < message.index(".step")
    assert len(message.split()) <= 80


def test_unchanged_or_boolean_static_leaves_do_not_warn():
    # A static float that keeps its value, and a bool flag that flips (a configuration
    # switch, compiled once per value on purpose), say nothing.
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
    # (Under the test suite's runtime type checks the `Literal` annotation catches it
    # first, as a TypeError.)
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
    opt = make_opt()
    step, params = make_step(opt), make_params()
    state = opt.init(params)

    def assembled(leaf: jax.Array) -> jax.Array:
        value = np.asarray(leaf)
        return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index: value[index])

    rebuilt = jax.tree.map(assembled, state)
    assert all(x.sharding.memory_kind == "pinned_host" and not host_typed(x)
               for x in offloaded_leaves(rebuilt))
    assert bits(rebuilt) == bits(state)
    new = train(jax.tree.map(jnp.copy, params), rebuilt, step, range(1))
    assert all(x.is_deleted() for x in jtu.tree_leaves(rebuilt))
    assert bits(new) == bits(train(params, state, step, range(1)))
    assert all(host_typed(x) for x in offloaded_leaves(new[1]))


# ---------------------------------------------------------------------------------------
# Compute on host-resident values


def test_host_compute_is_rejected_with_a_clear_error():
    host = jax.device_put(jnp.ones(3), jax.memory.Space.Host)
    f = eqx_offload.filter_jit(lambda x: x * 2)
    with pytest.raises(eqx_offload.CompositionError, match=r"`mul` on float32<host>\[3\]"):
        with count_compiles() as compiles:
            f(host)
    assert len(compiles) == 0


def test_host_compute_under_compute_on_is_allowed():
    # The function form of `compute_on` (`compute_on2` in JAX 0.10, `compute_on` from
    # 0.11).
    double = host_compute(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(
        lambda x: x * 2
    )
    host = jax.device_put(jnp.arange(3.0), jax.memory.Space.Host)
    out = eqx_offload.filter_jit(double)(host)
    assert out.sharding.memory_kind == "pinned_host"
    assert_tree_equal(jax.device_put(out, jax.memory.Space.Device), jnp.arange(3.0) * 2)


def test_a_host_slice_only_moved_to_the_device_passes_the_host_compute_check() -> None:
    """`filter_jit` allows fetching a host slice, not computing on it."""
    stacked = jax.device_put(jnp.arange(12.0).reshape(4, 3), jax.memory.Space.Host)

    def fetch(a: jax.Array, i: jax.Array) -> jax.Array:
        return jax.device_put(jax.lax.dynamic_slice(a, (i, 0), (1, 3)), jax.memory.Space.Device)[0] * 2

    out = eqx_offload.filter_jit(fetch)(stacked, jnp.int32(2))
    assert_tree_equal(out, jnp.arange(6.0, 9.0) * 2)
    with pytest.raises(eqx_offload.CompositionError, match="computes on host-resident"):
        eqx_offload.filter_jit(lambda a, i: jax.lax.dynamic_slice(a, (i, 0), (1, 3)) * 2)(
            stacked, jnp.int32(2))


def test_scan_over_steps_with_host_state():
    # Carrying the host state through `lax.scan` (several steps in one program) moves
    # it only: accepted, and equal to the same scan without offload.
    model = _model()
    params, static = eqx.partition(model, eqx.is_array)
    xs = jnp.stack([_batch() * i for i in range(1, 4)])

    def run(opt):
        step = _make_step(opt)

        def body(carry, x):
            params, state = carry
            model, state, loss = step(eqx.combine(params, static), state, x)
            return (eqx.filter(model, eqx.is_array), state), loss

        state = opt.init(params)
        return eqx_offload.filter_jit(lambda p, s: jax.lax.scan(body, (p, s), xs))(params, state)

    (p_off, s_off), losses_off = run(eqx_offload.offloaded(optax.adamw(1e-2)))
    (p_ref, s_ref), losses_ref = run(optax.adamw(1e-2))
    assert_tree_equal(losses_off, losses_ref)
    assert_tree_equal(p_off, p_ref)
    assert_tree_equal(s_off.inner_state, s_ref)
    assert kind_list(s_off) == _expected_state_kinds(s_off)


def test_donation_checks_can_fail():
    # The checks of `test_donation` see each kind of failure.
    reference = {"losses": ["a"], "model": ["b"], "state": ["c"]}
    good = {
        **reference, "deleted_state": [[True, True]], "deleted_model": [[True]],
        "warnings": [], "compiles": 1, "state_avals": ["float32[8,3]"],
    }
    assert _donation_failures(good, reference, "all") == []
    unusable = ("Some donated buffers were not usable: float32[8,3], float32[4,3].\n"
                "See an explanation at https://docs.jax.dev/en/latest/faq.html.")
    for bad, donate in [
        ({"losses": ["x"]}, "all"),
        ({"deleted_state": [[True, False]]}, "all"),
        ({"deleted_model": [[True]]}, "all-except-first"),
        ({"warnings": [unusable]}, "warn"),
        ({"warnings": [unusable]}, "all"),
        ({"compiles": 2}, "all"),
    ]:
        assert _donation_failures({**good, **bad}, reference, donate), (bad, donate)


def test_default_compiler_options_only_for_a_gpu_step_that_streams():
    """`filter_jit` adds its scheduler options only where they do something: for a GPU
    (the plan's `cuda`, a real `gpu`) when the step runs the streamed update, and
    another one when it brings a host state in one update (`group_bytes=None`: there
    the copy limit would let every copy start during the forward pass, and XLA's
    default estimator starts them all before it anyway). A streamed update in the same
    step wins. On the CPU nothing is added, so the program and its results are those
    of before."""
    from eqx_offload._compiler_options import (default_compiler_options, GPU_STREAMED_OPTIONS,
                                               GPU_WHOLE_STATE_OPTIONS)

    assert default_compiler_options("cpu", True) == {}
    assert default_compiler_options("cpu", False, whole=True) == {}
    assert default_compiler_options("cuda", False) == {}
    for platform in ("cuda", "gpu", "rocm"):
        assert default_compiler_options(platform, True) == GPU_STREAMED_OPTIONS
        assert default_compiler_options(platform, True, whole=True) == GPU_STREAMED_OPTIONS
        assert default_compiler_options(platform, False, whole=True) == GPU_WHOLE_STATE_OPTIONS
    assert GPU_STREAMED_OPTIONS["xla_gpu_experimental_parallel_async_compute_limit"] > 2
    assert GPU_WHOLE_STATE_OPTIONS == {"xla_gpu_enable_analytical_sol_latency_estimator": False}

    params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}

    def lowered_for_gpu(**options):
        opt = eqx_offload.offloaded(optax.adam(1e-3), **options)
        state = opt.init(params)

        @eqx_offload.filter_jit(donate="all-except-first")
        def step(params, state):
            updates, state = opt.update(params, state, params)
            return optax.apply_updates(params, updates), state

        return step.lower_for(("cuda",), (params, state), {}), step, state

    default, step, state = lowered_for_gpu()
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
    from eqx_offload._compiler_options import GPU_PREFETCHED_OPTIONS

    def defaults(layers: Any, prefetch: bool, platform: str = "cuda") -> dict[str, Any]:
        step = eqx_offload.filter_jit(jax.grad(lambda s, x: scan_loss(s, x, prefetch=prefetch)))
        return step.lower_for((platform,), (layers, jnp.ones(D)), {}).compiler_options

    on_host = eqx_offload.to_host(make_layers())
    assert defaults(on_host, True) == GPU_PREFETCHED_OPTIONS == {
        "xla_gpu_experimental_parallel_async_compute_limit": 32}
    assert defaults(on_host, False) == defaults(make_layers(), True) == {}
    assert defaults(on_host, True, "cpu") == {}


# ---------------------------------------------------------------------------------------
# `jax.export`


def _export_setup() -> tuple[Any, Any, Any]:
    params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    opt = eqx_offload.offloaded(optax.adam(1e-3))

    def step(params, state):
        updates, state = opt.update(params, state, params)
        return optax.apply_updates(params, updates), state

    return params, opt.init(params), step


@pytest.mark.parametrize("donate", ["none", "all"])
def test_export_keeps_memory_kinds_and_copies_for_cuda(donate: str) -> None:
    params, state, step = _export_setup()
    exported = eqx_offload.filter_jit(step, donate=donate).export(platforms=["cuda"])(params, state)
    text = exported.mlir_module()
    assert exported.platforms == ("cuda",)
    # Each of the 4 offloaded leaves: one copy to the device, one back.
    assert text.count("annotate_device_placement") >= 8
    kinds = re.findall(r'mhlo.memory_kind = "(\w+)"', text)
    assert kinds.count("pinned_host") == 8  # 4 state inputs, 4 state outputs


def test_export_runs_bitwise_on_this_backend() -> None:
    params, state, step = _export_setup()
    jitted = eqx_offload.filter_jit(step)
    exported = jitted.export()(params, state)
    out = exported.call(*jax.tree.leaves((params, state)))
    ref = jax.tree.leaves(jitted(params, state))
    assert_tree_equal(list(out), ref)
    assert [x.sharding.memory_kind for x in out] == [x.sharding.memory_kind for x in ref]
    assert {x.sharding.memory_kind for x in out if x.ndim} >= {"pinned_host"}


def test_export_of_plain_jit_with_specs_is_loud() -> None:
    # The silent case of the issue: specs from the arrays' own shardings, `jax.jit`
    # without shardings. The program has no copies; `offloaded` says so and names the
    # fix.
    params, state, step = _export_setup()
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                         (params, state))
    with pytest.warns(eqx_offload.OffloadWarning, match=r"filter_jit\(step\)\.export") as record:
        exported = jax.export.export(jax.jit(step), platforms=["cuda"])(*specs)
    assert "traced without the state's memory kinds" in str(record[0].message)
    ported = eqx_offload.filter_jit(step).export(platforms=["cuda"])(params, state)
    assert (exported.mlir_module().count("annotate_device_placement")
            < ported.mlir_module().count("annotate_device_placement"))


def test_export_of_streamed_and_host_compute_steps() -> None:
    params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    for options in ({"group_bytes": 0}, {"compute": "host"}):
        opt = eqx_offload.offloaded(optax.adam(1e-3), **options)
        state = opt.init(params)

        def step(params, state):
            updates, state = opt.update(params, state, params)
            return optax.apply_updates(params, updates), state

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            text = eqx_offload.filter_jit(step).export(platforms=["cuda"])(params, state).mlir_module()
        assert re.findall(r'mhlo.memory_kind = "(\w+)"', text).count("pinned_host") == 8, options
        assert np.ndim(state.inner_state[0].count) == 0

"""The streamed update (`offloaded(..., group_bytes=N)`) and the host-compute update
(`offloaded(..., compute="host")`): bitwise equality with the unwrapped optimizer, memory
kinds, the grouped structure of the compiled program, and what is rejected."""

import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_equal, count_compiles, Stacked
from jaxtyping import TypeCheckError

import eqx_offload
from eqx_offload._options import normalise


HOST_KINDS = ("pinned_host", "unpinned_host")


def committed(x: Any) -> jax.Array:
    """On the default device, committed: then the first and later calls of a jitted
    update share one executable (an uncommitted first argument compiles twice)."""
    return jax.device_put(np.asarray(x, np.float32), jax.devices()[0])


def make_params() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "embed": committed(rng.standard_normal((48, 16))),
        "layer": {"w": committed(rng.standard_normal((16, 8))), "b": committed(rng.standard_normal(8))},
        "scale": committed(0.5),  # a 0-d parameter: its moments are 0-d too
    }


def make_grads(params: Any, step: int) -> Any:
    rng = np.random.default_rng(100 + step)
    return jax.tree.map(lambda x: committed(rng.standard_normal(jnp.shape(x)) * 0.1), params)


def decay_mask(params: Any) -> Any:
    return jax.tree.map(lambda x: jnp.ndim(x) > 1, params)


# Per-leaf transformations (and combinations with a global statistic of the gradients,
# which needs no state): all must stream and run on host, bitwise.
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adagrad": lambda: optax.adagrad(1e-2),
    "nadam": lambda: optax.nadam(1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "clip_then_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(1e-2, mask=decay_mask)
    ),
    "schedule_adam": lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
}

MODES: dict[str, dict[str, Any]] = {
    "streamed_per_param": {"group_bytes": 0},
    "streamed_4KiB": {"group_bytes": 4096},
    "host_compute": {"compute": "host"},
}


def assert_offloaded_kinds(state: eqx_offload.OffloadedState) -> None:
    """Every array leaf with at least one dimension in pinned_host, 0-d leaves on device."""
    leaves = jax.tree.leaves(state.inner_state)
    assert leaves
    for leaf in leaves:
        kind = leaf.sharding.memory_kind
        assert kind == ("pinned_host" if leaf.ndim else "device"), (leaf.shape, kind)


def _two_steps_equal(step: Any, model: Any, state: Any, ref_step: Any, ref_model: Any,
                     ref_state: Any) -> None:
    """Two donated steps against the unwrapped optimizer's: bitwise equal model and
    state, donated inputs deleted, the state offloaded, one compile."""
    compiled: list[str] = []
    for _ in range(2):
        donated = jax.tree.leaves(state)
        with count_compiles("step") as compiles:
            model, state = step(model, state)
        compiled += compiles
        assert all(leaf.is_deleted() for leaf in donated)
        ref_model, ref_state = ref_step(ref_model, ref_state)
        assert_tree_equal(eqx.filter(model, eqx.is_array), eqx.filter(ref_model, eqx.is_array))
        assert_tree_equal(state.inner_state, ref_state)
        assert_offloaded_kinds(state)
    assert len(compiled) == 1


@pytest.mark.both  # the claim XLA versions could break: run in the newest environment too
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bitwise_equal_to_unwrapped(name: str, mode: str) -> None:
    params = make_params()
    ref = OPTIMIZERS[name]()
    opt = eqx_offload.offloaded(OPTIMIZERS[name](), **MODES[mode])
    ref_state = jax.device_put(ref.init(params), jax.devices()[0])  # committed, as `state`
    state = opt.init(params)
    assert_offloaded_kinds(state)
    ref_update = jax.jit(ref.update)
    update = jax.jit(opt.update)
    with count_compiles("update_fn") as compiled:
        for step in range(2):
            grads = make_grads(params, step)
            ref_updates, ref_state = ref_update(grads, ref_state, params)
            updates, state = update(grads, state, params)
            assert_tree_equal(updates, ref_updates)
            assert_tree_equal(state.inner_state, ref_state)
            assert_offloaded_kinds(state)
            assert {u.sharding.memory_kind for u in jax.tree.leaves(updates)} == {"device"}
            params = optax.apply_updates(params, updates)
    assert len(compiled) == 2  # one each


# ---------------------------------------------------------------------------------- rejected

REJECTED_STREAMING: dict[str, Callable[[], Any]] = {
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
    "clip_after_adam": lambda: optax.chain(optax.adam(1e-2), optax.clip_by_global_norm(1.0)),
}


@pytest.mark.parametrize("name", list(REJECTED_STREAMING))
def test_streaming_rejects_coupled_state(name: str) -> None:
    params = make_params()
    opt = eqx_offload.offloaded(REJECTED_STREAMING[name](), group_bytes=0)
    state = opt.init(params)
    with pytest.raises(eqx_offload.CompositionError, match="cannot be streamed") as info:
        jax.jit(opt.update)(make_grads(params, 0), state, params)
    message = str(info.value)
    assert "couples the state of" in message and "the coupling is made by `" in message
    # The same optimizer still works, bitwise, without streaming.
    plain, ref = eqx_offload.offloaded(REJECTED_STREAMING[name]()), REJECTED_STREAMING[name]()
    updates, state = jax.jit(plain.update)(make_grads(params, 0), plain.init(params), params)
    ref_updates, ref_state = jax.jit(ref.update)(make_grads(params, 0), ref.init(params), params)
    if name == "multi_steps":
        # `offloaded(MultiSteps)` keeps its accumulator on the device and returns +0.0
        # where MultiSteps returns `0 * u` for the update it discards (-0.0 for u < 0):
        # docs/how-to/gradient-accumulation.md; tests/test_accumulate.py tests it.
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(updates),
                                                        jax.tree.leaves(ref_updates)))
        assert_tree_equal(state.inner_state, ref_state)
        return
    assert_tree_equal((updates, state.inner_state), (ref_updates, ref_state))
    assert_offloaded_kinds(state)


@pytest.mark.parametrize("name", ["apply_if_finite", "multi_steps"])
def test_host_compute_rejects_control_flow_on_state(name: str) -> None:
    params = make_params()
    opt = eqx_offload.offloaded(REJECTED_STREAMING[name](), compute="host")
    state = opt.init(params)
    with pytest.raises(eqx_offload.CompositionError, match="`cond` at"):
        jax.jit(opt.update)(make_grads(params, 0), state, params)


def test_streaming_rejects_side_effects() -> None:
    def print_update(updates: Any, state: Any, params: Any = None) -> Any:
        jax.debug.print("{}", jax.tree.leaves(updates)[0].sum())
        return updates, state

    opt = eqx_offload.offloaded(
        optax.chain(optax.adam(1e-2), optax.GradientTransformation(lambda p: optax.EmptyState(), print_update)),
        group_bytes=0,
    )
    params = make_params()
    with pytest.raises(eqx_offload.CompositionError, match="side effects"):
        jax.jit(opt.update)(make_grads(params, 0), opt.init(params), params)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"compute": "gpu"}, "compute must be 'device' \\(default\\) or 'host'"),
        ({"group_bytes": -1}, ">= 0"),
        ({"group_bytes": 1.5}, "must be an int"),
        ({"group_bytes": True}, "must be an int"),
        ({"group_bytes": 0, "compute": "host"}, "exclude each other"),
        ({"lookahead": -1}, "lookahead must be an int >= 0"),
        ({"lookahead": 1.0}, "lookahead must be an int >= 0"),
        ({"host_dtype": "int8"}, "host_dtype must be a floating dtype"),
        ({"host_dtype": "not a dtype"}, "host_dtype must be a floating dtype"),
        ({"host_dtype": "bfloat16", "compute": "host"}, "nothing to narrow"),
    ],
)
def test_bad_options(kwargs: dict[str, Any], match: str) -> None:
    options = {"where": True, "memory_kind": "pinned_host", "group_bytes": None,
               "lookahead": 1, "compute": "device", "host_dtype": None, **kwargs}
    with pytest.raises(eqx_offload.OptionError, match=match) as info:
        normalise(**options)
    assert isinstance(info.value, (ValueError, TypeError))
    # `offloaded` runs the same check; under the test suite's runtime type checking a
    # value outside the annotated type is refused one step earlier, by jaxtyping.
    with pytest.raises((eqx_offload.OptionError, TypeCheckError)):
        eqx_offload.offloaded(optax.adam(1e-3), **kwargs)


# ---------------------------------------------------------------------------------- the plan

def test_stream_plan_groups() -> None:
    params = {f"p{i}": committed(np.ones((16, 16))) for i in range(4)}  # adam state: 2 KiB each
    opt = eqx_offload.offloaded(optax.adam(1e-3), group_bytes=0)
    inner_state = opt.init(params).inner_state

    def plan(group_bytes: int) -> eqx_offload.StreamPlan:
        return eqx_offload.stream_plan(
            optax.adam(1e-3), params, inner_state, params, group_bytes=group_bytes
        )

    finest = plan(0)
    # In reverse leaf order: the order the backward pass produces the gradients.
    assert finest.groups == tuple((f"0/mu/p{i}", f"0/nu/p{i}") for i in reversed(range(4)))
    assert finest.group_nbytes == (2048,) * 4
    assert finest.max_group_nbytes == 2048 and finest.total_nbytes == 8192
    assert finest.prologue == () and finest.resident == ("0/count",)
    pairs = plan(4096)
    assert pairs.groups == (
        ("0/mu/p2", "0/mu/p3", "0/nu/p2", "0/nu/p3"),
        ("0/mu/p0", "0/mu/p1", "0/nu/p0", "0/nu/p1"),
    )
    assert plan(4095).group_nbytes == (2048,) * 4
    assert plan(1 << 30).group_nbytes == (8192,)
    # "auto" (offloaded's default): about 1/16 of the streamed state, so here one
    # parameter's state per group (8 KiB / 16 = 512 B, below one unit).
    assert eqx_offload.stream_plan(optax.adam(1e-3), params, inner_state, params) == finest


def test_plan_prologue_when_counter_is_offloaded() -> None:
    params = make_params()
    opt = eqx_offload.offloaded(optax.adam(1e-2), where=True, group_bytes=0)
    state = opt.init(params)
    assert state.inner_state[0].count.sharding.memory_kind == "pinned_host"
    plan = eqx_offload.stream_plan(optax.adam(1e-2), params, state.inner_state, group_bytes=0)
    assert "0/count" in plan.prologue and "0/mu/scale" in plan.prologue
    ref = optax.adam(1e-2)
    ref_state = ref.init(params)
    for step in range(2):
        grads = make_grads(params, step)
        ref_updates, ref_state = jax.jit(ref.update)(grads, ref_state)
        updates, state = jax.jit(opt.update)(grads, state)
        assert_tree_equal(updates, ref_updates)
        assert_tree_equal(state.inner_state, ref_state)
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state)} == {"pinned_host"}


# ---------------------------------------------------------------------------------- the structure

def _events(text: str) -> list[tuple[str, str, list[str]]]:
    """The transfers and barriers of the `main` function of a StableHLO module, in
    program order: (kind, result, operands)."""
    main = text[text.index("func.func public @main"):]
    main = main[: main.index("\n  }")]
    events = []
    for line in main.splitlines():
        barrier = re.match(r"\s*(%[\w]+)(?::\d+)? = stablehlo\.optimization_barrier (.*?) :", line)
        if barrier:
            events.append(("barrier", barrier.group(1), barrier.group(2).split(", ")))
            continue
        move = re.match(
            r"\s*(%[\w]+) = stablehlo\.custom_call @annotate_device_placement\(([^)]*)\).*"
            r'_xla_buffer_placement = "(\w+)"',
            line,
        )
        if move:
            kind = "to_device" if move.group(3) == "device" else "to_host"
            events.append((kind, move.group(1), [move.group(2)]))
    return events


def _lower_for_gpu(opt: Any, params: Any) -> str:
    """The update's StableHLO as it is lowered for a CUDA GPU (no GPU needed): on the CPU
    backend `device_put` between memories lowers to nothing, on GPU and TPU to the
    `annotate_device_placement` custom calls that XLA turns into transfers."""
    state = opt.init(params)
    grads = make_grads(params, 0)
    traced = jax.jit(opt.update).trace(grads, state, params)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def _group_kinds(n_groups: int, per_group: int, lookahead: int) -> list[str]:
    """The transfers and barriers a streamed update of `n_groups` groups of
    `per_group` leaves lowers to: the first group waits for nothing; every later one
    waits in one barrier for the update before it (and, after the first
    `lookahead + 1`, for an earlier group's state on host)."""
    kinds = []
    for g in range(n_groups):
        kinds += ["barrier"] * (g > 0) + ["to_device"] * per_group + ["to_host"] * per_group
    return kinds


def _arguments(text: str, memory_kind: str = "") -> list[str]:
    """The `main` function's arguments (those in `memory_kind`, if given), in order."""
    header = text[text.index("func.func public @main"):]
    header = header[: header.index("{\n")]
    found = re.findall(r"(%arg\d+): tensor<[^>]*>( \{[^}]*\})?", header)
    return [a for a, attrs in found if memory_kind in attrs]


@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_streamed_program_structure(lookahead: int) -> None:
    """Group g comes in after group g - 1's update has run and group g - 1 - lookahead
    is back on host, and after nothing else: with lookahead=1 (double buffering) no
    transfer of group k + 1 to the device waits for group k's copy back, so the copies
    in and out overlap the updates; no gradient is fenced (XLA sees their data flow as
    in the unwrapped update)."""
    params = {f"p{i}": committed(np.full((32, 32), i)) for i in range(5)}
    opt = eqx_offload.offloaded(optax.adam(1e-3), group_bytes=0, lookahead=lookahead)
    text = _lower_for_gpu(opt, params)
    gradients = set(_arguments(text)[:5])  # `update(grads, state, params)`: grads first
    host = set(_arguments(text, "pinned_host"))
    assert len(host) == 10 and not host & gradients
    events = _events(text)
    assert [kind for kind, _, _ in events] == _group_kinds(5, 2, lookahead)
    # Each group's two moves in, in order, the values its two moves out send (its new
    # state on the device) and their results (on host).
    groups_in, groups_new, groups_out = [], [], []
    for i, (kind, result, (operand, *_)) in enumerate(events):
        if kind == "to_device" and (not groups_in or len(groups_in[-1]) == 2):
            groups_in.append([])
        if kind == "to_device":
            groups_in[-1].append((operand, i))
        if kind == "to_host" and (not groups_out or len(groups_out[-1]) == 2):
            groups_out.append([])
            groups_new.append([])
        if kind == "to_host":
            groups_out[-1].append(result)
            groups_new[-1].append(operand)
    barriers = {result: operands for kind, result, operands in events if kind == "barrier"}
    for g, moves in enumerate(groups_in):
        sources = {operand.split("#")[0] for operand, _ in moves}
        if g == 0:
            # straight from the arguments (host): free to start at the top of the step
            assert sources <= host, sources
            continue
        (barrier,) = sources  # what comes in passed through one barrier ...
        operands = barriers[barrier]
        # ... with the group's own state, straight from the arguments ...
        assert len(host & set(operands)) == 2, operands
        # ... after the new state of the group before it, as computed on the device ...
        assert set(groups_new[g - 1]) <= set(operands), (g, operands)
        assert not gradients & set(operands), (g, operands)
        if g <= lookahead:
            assert len(operands) == 4, (g, operands)
            continue
        # ... and the state of group g - 1 - lookahead, already sent to host ...
        assert set(groups_out[g - 1 - lookahead]) <= set(operands), (g, operands)
        # ... and nothing else: not the groups in between on host (they overlap this
        # copy), and no other device value (the updates are left to XLA, to fuse).
        assert len(operands) == 6, operands
        for between in groups_out[g - lookahead: g]:
            assert not set(between) & set(operands), (g, operands)


@pytest.mark.parametrize("lookahead", [0, 1])
def test_cpu_program_has_the_same_barrier_chain(lookahead: int) -> None:
    """On the CPU backend the moves between memories lower to nothing (one RAM), but the
    barriers that order the groups are there, each taking its group's host arguments."""
    params = {f"p{i}": committed(np.full((32, 32), i)) for i in range(4)}
    opt = eqx_offload.offloaded(optax.adam(1e-3), group_bytes=0, lookahead=lookahead)
    state = opt.init(params)
    text = jax.jit(opt.update).lower(params, state, params).as_text()
    events = _events(text)
    assert [kind for kind, _, _ in events] == ["barrier"] * 3
    host_args = set(re.findall(r"(%arg\d+): tensor<[^>]*> \{mhlo.memory_kind = \"pinned_host\"", text))
    assert len(host_args) == 8
    for _, _, operands in events:
        assert len(host_args & set(operands)) == 2


def test_default_program_moves_the_whole_state_at_once() -> None:
    """The contrast: with `group_bytes=None` every state leaf comes in before any goes out."""
    params = {f"p{i}": committed(np.full((32, 32), i)) for i in range(4)}
    opt = eqx_offload.offloaded(optax.adam(1e-3), group_bytes=None)
    kinds = [kind for kind, _, _ in _events(_lower_for_gpu(opt, params))]
    assert kinds == ["to_device"] * 8 + ["to_host"] * 8


@pytest.mark.parametrize("lookahead", [0, 1])
def test_grouping_follows_group_bytes_in_the_program(lookahead: int) -> None:
    params = {f"p{i}": committed(np.full((32, 32), i)) for i in range(6)}  # 8 KiB of state each
    opt = eqx_offload.offloaded(optax.adam(1e-3), group_bytes=16 * 1024, lookahead=lookahead)
    kinds = [kind for kind, _, _ in _events(_lower_for_gpu(opt, params))]
    assert kinds == _group_kinds(3, 4, lookahead)


def test_host_compute_program_keeps_the_state_on_host() -> None:
    params = {f"p{i}": committed(np.full((32, 32), i)) for i in range(2)}
    opt = eqx_offload.offloaded(optax.adam(1e-3), compute="host")
    text = _lower_for_gpu(opt, params)
    assert '_xla_compute_type = "host"' in text
    events = _events(text)
    call = re.search(r"(%\w+):\d+ = call @\w+\(.*_xla_compute_type = \"host\"", text)
    assert call is not None
    from_host_call = lambda operand: operand.startswith(call.group(1) + "#")  # noqa: E731
    to_device = [operand for kind, _, (operand,) in events if kind == "to_device"]
    to_host = [operand for kind, _, (operand,) in events if kind == "to_host"]
    # In: the gradients and the step counter go to host; the state (host arguments) is
    # passed to the host computation as it is and never goes to the device.
    assert [op for op in to_host if op.startswith("%arg")] == ["%arg0", "%arg1", "%arg2"]
    assert all(from_host_call(op) for op in to_device)
    # Out: the two updates and the step counter come to the device, mu and nu stay host.
    assert len(to_device) == 3
    assert len([op for op in to_host if from_host_call(op)]) == 4


# ---------------------------------------------------------------------------------- use

@pytest.mark.parametrize("mode", list(MODES))
def test_training_step_with_filter_jit_donation(mode: str) -> None:
    model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (8,))

    def make_step(opt: Any) -> Callable[..., Any]:
        def step(model: Any, state: Any) -> Any:
            grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
            updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state

        return step

    ref_opt = optax.adamw(1e-2)
    ref_model = jax.tree.map(lambda v: jnp.copy(v) if eqx.is_array(v) else v, model)
    ref_state = ref_opt.init(eqx.filter(ref_model, eqx.is_array))
    ref_step = eqx.filter_jit(make_step(ref_opt))
    opt = eqx_offload.offloaded(optax.adamw(1e-2), **MODES[mode])
    state = opt.init(eqx.filter(model, eqx.is_array))
    step = eqx_offload.filter_jit(make_step(opt), donate="all")
    _two_steps_equal(step, model, state, ref_step, ref_model, ref_state)


@pytest.mark.parametrize("memory_kind", HOST_KINDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_eager_update_is_the_jitted_update(mode: str, memory_kind: str) -> None:
    """Outside `jit` the streamed update is compiled (op by op it would bound nothing),
    so it equals `jax.jit(inner.update)`; the state lands in `memory_kind`."""
    params = make_params()
    grads = make_grads(params, 0)
    ref_updates, ref_state = jax.jit(optax.nadam(1e-2).update)(grads, optax.nadam(1e-2).init(params))
    opt = eqx_offload.offloaded(optax.nadam(1e-2), memory_kind=memory_kind, **MODES[mode])
    updates, state = opt.update(grads, opt.init(params))
    assert_tree_equal(updates, ref_updates)
    assert_tree_equal(state.inner_state, ref_state)
    for leaf in jax.tree.leaves(state.inner_state):
        assert leaf.sharding.memory_kind == (memory_kind if leaf.ndim else "device")


def test_sharded_state_keeps_its_sharding() -> None:
    mesh = jax.make_mesh((4,), ("x",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    params = {
        "a": jax.device_put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8) / 100, spec),
        "b": jax.device_put(jnp.ones((16,)), spec),
    }
    ref_updates, ref_state = jax.jit(optax.adam(1e-2).update)(params, optax.adam(1e-2).init(params))
    for mode in MODES.values():
        opt = eqx_offload.offloaded(optax.adam(1e-2), **mode)
        updates, state = jax.jit(opt.update)(params, opt.init(params))
        assert_tree_equal(updates, ref_updates)
        assert_tree_equal(state.inner_state, ref_state)
        for leaf in (state.inner_state[0].mu["a"], state.inner_state[0].nu["b"]):
            assert leaf.sharding.memory_kind == "pinned_host"
            assert leaf.sharding.spec[0] == "x"


def test_extra_args_reach_the_inner_update() -> None:
    def scale_by_arg() -> optax.GradientTransformationExtraArgs:
        def update(updates: Any, state: Any, params: Any = None, *, factor: Any) -> Any:
            return jax.tree.map(lambda u: u * factor, updates), state

        return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)

    params = make_params()
    grads = make_grads(params, 0)
    ref = optax.chain(optax.adam(1e-2), scale_by_arg())
    ref_updates, _ = jax.jit(ref.update)(grads, ref.init(params), params, factor=jnp.float32(3.0))
    for mode in MODES.values():
        opt = eqx_offload.offloaded(optax.chain(optax.adam(1e-2), scale_by_arg()), **mode)
        updates, _ = jax.jit(opt.update)(grads, opt.init(params), params, factor=jnp.float32(3.0))
        assert_tree_equal(updates, ref_updates)


@pytest.mark.parametrize("name", ["adamw", "clip_then_adamw", "apply_if_finite"])
def test_default_streams_when_compiled_for_an_accelerator(name: str) -> None:
    """`group_bytes="auto"` (the default) streams under `jit` for an accelerator, and
    brings the whole state at once for the CPU backend (one RAM: nothing to free) and
    for updates that cannot stream (`apply_if_finite`): one trace holds both, and the
    platform it is lowered for picks (`gpu_plan` lowers for `cuda` on a CPU machine).
    On the CPU it runs bitwise as the unwrapped optimizer."""
    make = {**OPTIMIZERS, **REJECTED_STREAMING}[name]
    params = {f"p{i}": committed(np.full((16, 16), i / 8)) for i in range(6)}
    ref, opt = make(), eqx_offload.offloaded(make())
    grads = make_grads(params, 0)
    update = jax.jit(lambda g, s, p: opt.update(g, s, p))
    traced = update.trace(grads, opt.init(params), params)

    assert traced.lower(lowering_platforms=("cpu",)).as_text().count("optimization_barrier") == 0
    streamed = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert (streamed.count("optimization_barrier") > 0) == (name != "apply_if_finite")
    updates, state = update(grads, opt.init(params), params)
    ref_updates, ref_state = jax.jit(ref.update)(grads, ref.init(params), params)
    assert_tree_equal((updates, state.inner_state), (ref_updates, ref_state))
    assert_offloaded_kinds(state)


# ---------------------------------------------------------------------------------- stacked layers

def product_update() -> optax.GradientTransformation:
    """An update made by a product that `apply_updates` adds to (no trailing scalar
    operation): its rows are concatenated, not written into the gradient's buffer."""
    def update(updates: Any, state: Any, params: Any = None) -> Any:
        m = jax.tree.map(lambda m, g: 0.5 * m + g, state, updates)
        return jax.tree.map(lambda m, g: 1e-2 * m * g, m, updates), m

    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


WIDTH, DEPTH = 32, 4
LAYER_BYTES = 2 * WIDTH * WIDTH * 4  # two moments of one layer's weight, float32

# (optimizer, whether the stacked weight's state is split by layer)
STACKED: dict[str, tuple[Callable[[], Any], bool]] = {
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), True),
    # The global norm is taken on the whole gradients first; the pieces only scale them.
    "clip_then_adam": (lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)), True),
    "product": (product_update, True),
    # A trust ratio per leaf: norms over all rows of each leaf, so the leaf comes whole.
    "lamb": (lambda: optax.lamb(1e-2), False),
}


@pytest.mark.parametrize("name", list(STACKED))
def test_stacked_leaves_stream_by_layer(name: str) -> None:
    """A training step on a scanned stack of layers: the stacked weight's state streams
    layer by layer (`group_bytes` of one layer's moments), bitwise equal to the
    unwrapped optimizer, state donated and back in host memory, one compilation; an
    update that reduces across the rows of a leaf brings it whole, still bitwise."""
    make, split = STACKED[name]
    model = Stacked(WIDTH, DEPTH, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, WIDTH))

    def make_step(opt: Any) -> Callable[..., Any]:
        def step(model: Any, state: Any) -> Any:
            grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
            updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state

        return step

    params = eqx.filter(model, eqx.is_array)
    opt = eqx_offload.offloaded(make(), group_bytes=LAYER_BYTES)
    state = opt.init(params)
    plan = eqx_offload.stream_plan(make(), params, state.inner_state, params,
                                   group_bytes=LAYER_BYTES)
    rows = [path for group in plan.groups for path in group if path.endswith("]")]
    if split:
        # pieces of the weight's rows (the biases are matrices, brought whole)
        assert len({path.rsplit("[", 1)[1] for path in rows}) >= 2, plan.groups
        assert all("layers/weight[" in path for path in rows), plan.groups
        assert max(plan.group_nbytes) <= LAYER_BYTES
    else:
        assert rows == [] and max(plan.group_nbytes) >= DEPTH * LAYER_BYTES

    ref_opt = make()
    ref_model = jax.tree.map(lambda v: jnp.copy(v) if eqx.is_array(v) else v, model)
    ref_state = ref_opt.init(eqx.filter(ref_model, eqx.is_array))
    ref_step = eqx.filter_jit(make_step(ref_opt))
    step = eqx_offload.filter_jit(make_step(opt), donate="all")
    _two_steps_equal(step, model, state, ref_step, ref_model, ref_state)


def test_stacked_rows_read_ahead_of_writes() -> None:
    """With two groups ahead (the rows of the next two pieces are read from the host
    buffer before earlier pieces are written into it, in place), `jax.jit(update)`
    equals the unwrapped update, bitwise, and every state leaf stays in host memory;
    `host_dtype` narrows the rows as it narrows whole leaves."""
    rng = np.random.default_rng(4)
    params = {"w": committed(rng.standard_normal((6, 16, 16))), "v": committed(rng.standard_normal((16, 4)))}
    grads = [make_grads(params, step) for step in range(2)]
    ref, opt = optax.adamw(1e-2), eqx_offload.offloaded(
        optax.adamw(1e-2), group_bytes=2 * 16 * 16 * 4, lookahead=2)
    ref_state, state = ref.init(params), opt.init(params)
    for g in grads:
        ref_updates, ref_state = jax.jit(ref.update)(g, ref_state, params)
        updates, state = jax.jit(opt.update)(g, state, params)
        assert_tree_equal((updates, state.inner_state), (ref_updates, ref_state))
        assert_offloaded_kinds(state)
    narrow = dict(host_dtype=jnp.bfloat16, lookahead=2)
    sliced = eqx_offload.offloaded(optax.adam(1e-2), group_bytes=0, **narrow)
    whole = eqx_offload.offloaded(optax.adam(1e-2), group_bytes=None, **narrow)
    a, b = sliced.init(params), whole.init(params)
    for g in grads:
        ua, a = jax.jit(sliced.update)(g, a)
        ub, b = jax.jit(whole.update)(g, b)
        assert_tree_equal((ua, a.inner_state), (ub, b.inner_state))
    assert a.inner_state[0].mu["w"].dtype == jnp.bfloat16
    assert a.inner_state[0].mu["w"].sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("spec", [(None, "x"), ("x",)], ids=["columns", "rows"])
def test_stacked_sharded_leaves(spec: tuple[Any, ...]) -> None:
    """A stacked leaf sharded across devices keeps its sharding and stays bitwise: split
    by rows when its columns are sharded; brought whole when its rows are (JAX cannot
    cut a few rows out of a leaf sharded along them), or when it is the only parameter
    (its pieces would make Adam's bias corrections read by several operations, which XLA
    rewrites differently from one; see `_keep_scalar_uses`)."""
    mesh = jax.make_mesh((4,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    w = jnp.arange(8 * 16 * 16, dtype=jnp.float32).reshape(8, 16, 16) / 1000
    params = {"w": jax.device_put(w, sharding), "b": jax.device_put(jnp.ones((8, 16)), sharding)}
    group_bytes = 2 * 16 * 16 * 4

    def split(params: Any) -> bool:
        state = eqx_offload.offloaded(optax.adamw(1e-2), group_bytes=group_bytes).init(params)
        plan = eqx_offload.stream_plan(optax.adamw(1e-2), params, state.inner_state, params,
                                       group_bytes=group_bytes)
        return any(path.endswith("]") for group in plan.groups for path in group)

    assert split(params) == (spec[0] is None)
    assert not split({"w": params["w"]})
    ref, opt = optax.adamw(1e-2), eqx_offload.offloaded(optax.adamw(1e-2), group_bytes=group_bytes)
    ref_state, state = ref.init(params), opt.init(params)
    for step in range(2):
        grads = jax.tree.map(lambda p: p * (step + 1) * 0.1, params)
        ref_updates, ref_state = jax.jit(ref.update)(grads, ref_state, params)
        updates, state = jax.jit(opt.update)(grads, state, params)
        assert_tree_equal((updates, state.inner_state), (ref_updates, ref_state))
    for leaf in jax.tree.leaves(state.inner_state[0].mu):
        assert leaf.sharding.memory_kind == "pinned_host"
        assert tuple(leaf.sharding.spec)[: len(spec)] == spec

"""The streamed update (`_stream/stream.py`) and the host-compute update: the programs they lower
to (for a GPU, without one), the default's choice of streaming, stacked leaves streamed by
rows, and state copies to the device that wait for nothing."""

import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_placed, assert_tree_equal, committed, count_compiles, make_grads, make_params, Stacked
from helpers import REJECTED_STREAMING

import eqx_offload


pytestmark = pytest.mark.both  # (bitwise claims an XLA release can break: the newest too)


@pytest.mark.parametrize("name", ["apply_if_finite", "multi_steps"])
def test_host_compute_rejects_control_flow_on_state(name: str) -> None:
    params = make_params()
    opt = eqx_offload.offloaded(REJECTED_STREAMING[name](), compute="host")
    with pytest.raises(eqx_offload.errors.CompositionError, match="`cond` at"):
        jax.jit(opt.update)(make_grads(params, 0), opt.init(params), params)


def _events(text: str) -> list[tuple[str, str, list[str]]]:
    """`(kind, result, operands)` of each transfer and barrier of a StableHLO `main`."""
    main = text[text.index("func.func public @main"):]
    main = main[: main.index("\n  }")]
    events = []
    for line in main.splitlines():
        barrier = re.match(r"\s*(%[\w]+)(?::\d+)? = stablehlo\.optimization_barrier (.*?) :", line)
        if barrier:
            events.append(("barrier", barrier.group(1), barrier.group(2).split(", ")))
            continue
        move = re.match(r"\s*(%[\w]+) = stablehlo\.custom_call @annotate_device_placement"
                        r'\(([^)]*)\).*_xla_buffer_placement = "(\w+)"', line)
        if move:
            kind = "to_device" if move.group(3) == "device" else "to_host"
            events.append((kind, move.group(1), [move.group(2)]))
    return events


def _lowered(n: int, platforms: Any = ("cuda",), **options: Any) -> str:
    """The StableHLO of `offloaded(adam, **options).update` of `n` (32, 32) parameters, for a
    CUDA GPU by default (no GPU needed): there, unlike on the CPU, `device_put` between
    memories lowers to `annotate_device_placement` calls that XLA turns into transfers."""
    params = {f"p{i}": committed(np.full((32, 32), i)) for i in range(n)}
    opt = eqx_offload.offloaded(optax.adam(1e-3), **options)
    traced = jax.jit(opt.update).trace(make_grads(params, 0), opt.init(params), params)
    return traced.lower(lowering_platforms=platforms).as_text()


def _group_kinds(n_groups: int, per_group: int) -> list[str]:
    """The transfers and barriers of a streamed update of `n_groups` groups: every group but
    the first waits in one barrier."""
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
    """Group g comes in after group g - 1's update has run and group g - 1 - lookahead is
    back on host, and after nothing else: with lookahead=1 no copy of group k + 1 to the
    device waits for group k's copy back, so copies overlap updates; no gradient is fenced."""
    text = _lowered(5, group_bytes=0, lookahead=lookahead)
    gradients = set(_arguments(text)[:5])  # `update(grads, state, params)`: grads first
    host = set(_arguments(text, "pinned_host"))
    assert len(host) == 10 and not host & gradients
    events = _events(text)
    assert [kind for kind, _, _ in events] == _group_kinds(5, 2)
    moves = [(result, operands[0]) for kind, result, operands in events if kind != "barrier"]
    groups = [moves[i:i + 4] for i in range(0, len(moves), 4)]  # two moves in, two out
    new = [{operand for _, operand in group[2:]} for group in groups]  # sent out (device)
    out = [{result for result, _ in group[2:]} for group in groups]  # sent out (on host)
    barriers = {result: operands for kind, result, operands in events if kind == "barrier"}
    for g, group in enumerate(groups):
        sources = {operand.split("#")[0] for _, operand in group[:2]}
        if g == 0:  # straight from the arguments (host): free to start at the top of the step
            assert sources <= host, sources
            continue
        (barrier,) = sources  # what comes in passed through one barrier ...
        operands = barriers[barrier]
        # ... with the group's own state, straight from the arguments ...
        assert len(host & set(operands)) == 2, operands
        # ... after the new state of the group before it, as computed on the device ...
        assert new[g - 1] <= set(operands), (g, operands)
        assert not gradients & set(operands), (g, operands)
        if g <= lookahead:
            assert len(operands) == 4, (g, operands)
            continue
        # ... and the state of group g - 1 - lookahead, already sent to host ...
        assert out[g - 1 - lookahead] <= set(operands), (g, operands)
        # ... and nothing else: not the groups in between on host (they overlap this
        # copy), and no other device value (the updates are left to XLA, to fuse).
        assert len(operands) == 6, operands
        for between in out[g - lookahead: g]:
            assert not between & set(operands), (g, operands)


@pytest.mark.parametrize("lookahead", [0, 1])
def test_cpu_program_has_the_same_barrier_chain(lookahead: int) -> None:
    """On the CPU backend the moves between memories lower to nothing (one RAM), but the
    barriers that order the groups are there, each taking its group's host arguments."""
    text = _lowered(4, platforms=None, group_bytes=0, lookahead=lookahead)
    events = _events(text)
    assert [kind for kind, _, _ in events] == ["barrier"] * 3
    host_args = set(re.findall(r"(%arg\d+): tensor<[^>]*> \{mhlo.memory_kind = \"pinned_host\"", text))
    assert len(host_args) == 8
    for _, _, operands in events:
        assert len(host_args & set(operands)) == 2


@pytest.mark.parametrize("n,options,kinds", [
    # the whole state at once, once the gradients are made (one barrier)
    (4, {"group_bytes": None}, ["barrier"] + ["to_device"] * 8 + ["to_host"] * 8),
    *[(6, {"group_bytes": 16 * 1024, "lookahead": k}, _group_kinds(3, 4)) for k in (0, 1)],
], ids=["whole", "16KiB-lookahead0", "16KiB-lookahead1"])
def test_grouping_follows_group_bytes_in_the_program(n: int, options: Any, kinds: Any) -> None:
    """Groups of 16 KiB of state (8 KiB a parameter); `None`: all in, after the gradients,
    before any goes out."""
    assert [kind for kind, _, _ in _events(_lowered(n, **options))] == kinds


def test_whole_state_comes_after_every_gradient() -> None:
    """`group_bytes=None` for an accelerator: one barrier takes the whole state, still
    on host, and every gradient; every transfer to the device reads what it passed. On
    the CPU there is no barrier (the one RAM: nothing to order)."""
    text = _lowered(4, group_bytes=None)
    (kind, _, operands), *moves = _events(text)
    assert kind == "barrier"
    host_args = set(re.findall(r"(%arg\d+): tensor<[^>]*> \{mhlo.memory_kind = \"pinned_host\"", text))
    assert len(host_args) == 8 and host_args <= set(operands)
    assert len(operands) == 9 + 4, operands  # the state (the count too), four gradients
    # (the barrier sits in the branch `platform_dependent` lowers for the GPU; the moves
    # read that branch's results, one value)
    assert len({m[2][0].split("#")[0] for m in moves if m[0] == "to_device"}) == 1
    assert _events(_lowered(4, platforms=None, group_bytes=None)) == []


def test_host_compute_program_keeps_the_state_on_host() -> None:
    text = _lowered(2, compute="host")
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


@pytest.mark.parametrize("name", ["adamw", "clip_then_adamw", "apply_if_finite"])
def test_default_streams_when_compiled_for_an_accelerator(name: str) -> None:
    """The default `group_bytes="auto"` streams for an accelerator, brings the whole state for
    the CPU (one RAM) and for updates that cannot stream: one trace, the platform it is
    lowered for picks. On the CPU it runs bitwise as the unwrapped optimizer."""
    make = {"adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
            "clip_then_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
            **REJECTED_STREAMING}[name]
    params = {f"p{i}": committed(np.full((16, 16), i / 8)) for i in range(6)}
    ref, opt = make(), eqx_offload.offloaded(make())
    grads = make_grads(params, 0)
    update = jax.jit(lambda g, s, p: opt.update(g, s, p))
    traced = update.trace(grads, opt.init(params), params)
    assert traced.lower(lowering_platforms=("cpu",)).as_text().count("optimization_barrier") == 0
    streamed = traced.lower(lowering_platforms=("cuda",)).as_text()
    # streamed: a barrier per group; the whole state: one, after the gradients
    barriers = streamed.count("optimization_barrier")
    assert barriers > 1 if name != "apply_if_finite" else barriers == 1
    updates, state = update(grads, opt.init(params), params)
    ref_updates, ref_state = jax.jit(ref.update)(grads, ref.init(params), params)
    assert_tree_equal((updates, state.inner_state), (ref_updates, ref_state))
    assert_placed(state)


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
    """A step on a scanned stack of layers: the stacked weight's state streams layer by layer
    (an update that reduces across a leaf's rows brings it whole), bitwise the unwrapped
    optimizer's, the state donated and back in host memory, one compilation."""
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
    plan = eqx_offload.stream.stream_plan(make(), params, state.inner_state, params,
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
    compiled: list[str] = []
    for _ in range(2):
        donated = jax.tree.leaves(state)
        with count_compiles("step") as compiles:
            model, state = step(model, state)
        compiled += compiles
        assert all(leaf.is_deleted() for leaf in donated)
        ref_model, ref_state = ref_step(ref_model, ref_state)
        assert_tree_equal((eqx.filter(model, eqx.is_array), state.inner_state),
                          (eqx.filter(ref_model, eqx.is_array), ref_state))
        assert_placed(state)
    assert len(compiled) == 1


def test_stacked_rows_read_ahead_of_writes() -> None:
    """Two groups ahead (rows read from the host buffer before earlier pieces are written into
    it, in place): bitwise the unwrapped update, the state in host memory; `host_dtype`
    narrows the rows as it narrows whole leaves."""
    rng = np.random.default_rng(4)
    params = {"w": committed(rng.standard_normal((6, 16, 16))), "v": committed(rng.standard_normal((16, 4)))}
    grads = [make_grads(params, step) for step in range(2)]
    ref, opt = optax.adamw(1e-2), eqx_offload.offloaded(
        optax.adamw(1e-2), group_bytes=2 * 16 * 16 * 4, lookahead=2)
    _bitwise_the_unwrapped(ref, opt, params, grads)
    a = _sliced_equals_whole(params, grads, host_dtype=jnp.bfloat16, lookahead=2)
    assert a.inner_state[0].mu["w"].dtype == jnp.bfloat16
    assert a.inner_state[0].mu["w"].sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_stacked_leaves_take_turns(lookahead: int) -> None:
    """The pieces of two stacked leaves, taking turns (`groups.interleave`), read ahead of
    the writes of the other leaf's pieces: bitwise the unwrapped update, the state in
    host memory; with 8-bit state, equal to the whole state brought at once."""
    rng = np.random.default_rng(5)
    params = {"w": committed(rng.standard_normal((6, 16, 16))),
              "u": committed(rng.standard_normal((6, 16, 8))),
              "v": committed(rng.standard_normal((16, 4)))}
    grads = [make_grads(params, step) for step in range(2)]
    ref = optax.adamw(1e-2)
    opt = eqx_offload.offloaded(optax.adamw(1e-2), group_bytes=2 * 16 * 16 * 4,
                                lookahead=lookahead)
    plan = eqx_offload.stream.stream_plan(optax.adamw(1e-2), params, opt.init(params).inner_state,
                                          params, group_bytes=2 * 16 * 16 * 4)
    firsts = [group[0].split("/")[2][0] for group in plan.groups]
    assert firsts[:5] == ["v", "w", "u", "w", "u"], plan.groups
    _bitwise_the_unwrapped(ref, opt, params, grads)
    _sliced_equals_whole(params, grads, host_dtype=jnp.int8, lookahead=lookahead)


def test_stacked_pieces_fenced_on_the_cpu_only() -> None:
    """Lowered for the CPU, each piece's rows of state come in, and its new rows and its
    update go out, through a barrier of their own (XLA:CPU then compiles a piece's
    arithmetic as the whole update's: the bitwise tests around this one); lowered for a
    TPU or a GPU, the pieces add no barrier (their temporaries stay as they are)."""
    params = {"w": committed(np.ones((6, 16, 16))), "u": committed(np.ones((6, 16, 8)))}
    opt = eqx_offload.offloaded(optax.adamw(1e-2), group_bytes=2 * 16 * 16 * 4)
    traced = jax.jit(opt.update).trace(make_grads(params, 0), opt.init(params), params)
    cpu, tpu, cuda = (traced.lower(lowering_platforms=(platform,)).as_text()
                      .count("stablehlo.optimization_barrier") for platform in ("cpu", "tpu", "cuda"))
    assert tpu == cuda
    # 6 pieces of `w` (a row each), 3 of `u` (two rows); each reads and writes mu and nu,
    # and writes its rows of the update
    assert cpu - tpu == (6 + 3) * (2 + 2 + 1)


def test_stacked_pieces_of_rmsprop() -> None:
    """RMSProp's pieces (one moment: pieces of 2 and 4 rows) stay bitwise the unwrapped
    update, its rows of the update written into the gradient's buffer as computed."""
    rng = np.random.default_rng(5)
    params = {"w": committed(rng.standard_normal((6, 16, 16))),
              "u": committed(rng.standard_normal((6, 16, 8)))}
    grads = [make_grads(params, step) for step in range(2)]
    opt = eqx_offload.offloaded(optax.rmsprop(1e-2), group_bytes=2 * 16 * 16 * 4)
    _bitwise_the_unwrapped(optax.rmsprop(1e-2), opt, params, grads)


@pytest.mark.parametrize("spec", [(None, "x"), ("x",)], ids=["columns", "rows"])
def test_stacked_sharded_leaves(spec: tuple[Any, ...]) -> None:
    """A sharded stacked leaf keeps its sharding and stays bitwise: split by rows when its
    columns are sharded; whole when its rows are (JAX cannot cut rows out of it), or when it
    is the only parameter (Adam's bias corrections read once: `_keep_scalar_uses`)."""
    mesh = jax.make_mesh((4,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    w = jnp.arange(8 * 16 * 16, dtype=jnp.float32).reshape(8, 16, 16) / 1000
    params = {"w": jax.device_put(w, sharding), "b": jax.device_put(jnp.ones((8, 16)), sharding)}
    group_bytes = 2 * 16 * 16 * 4

    def split(params: Any) -> bool:
        state = eqx_offload.offloaded(optax.adamw(1e-2), group_bytes=group_bytes).init(params)
        plan = eqx_offload.stream.stream_plan(optax.adamw(1e-2), params, state.inner_state, params,
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


@pytest.mark.parametrize("group_bytes", [None, 0])
def test_state_copies_to_the_device_wait_for_what_they_must(group_bytes: Any) -> None:
    """For a GPU, the first streamed group's state copies read step arguments directly
    (the rest wait for the group before); the whole state's wait for the gradients."""
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    params = jax.device_put(eqx.filter(model, eqx.is_array), jax.devices()[0])
    opt = eqx_offload.offloaded(optax.adam(0.1), group_bytes=group_bytes, lookahead=1)
    state = opt.init(params)
    static = eqx.filter(model, eqx.is_array, inverse=True)

    def step(params: Any, state: Any, x: jax.Array) -> Any:
        grads = jax.grad(lambda p: jnp.sum(jax.vmap(eqx.combine(p, static))(x) ** 2))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    text = jax.jit(step).trace(params, state, jnp.ones((4, 3))).lower(
        lowering_platforms=("cuda",)).as_text()
    operands = re.findall(r"annotate_device_placement\((%[\w#]+)\).*_xla_buffer_placement = "
                          r"\"device\"", text)
    n_state = sum(x.ndim > 0 for x in jax.tree.leaves(state))
    assert len(operands) == n_state
    free = [op for op in operands if op.startswith("%arg")]
    assert len(free) == (0 if group_bytes is None else 2)  # mu, nu of the first group


def _sliced_equals_whole(params: Any, grads: list[Any], **options: Any) -> Any:
    """`offloaded(adam, **options)` streamed by rows (`group_bytes=0`) against the whole
    state at once: equal updates and state at every step; the streamed state."""
    sliced = eqx_offload.offloaded(optax.adam(1e-2), group_bytes=0, **options)
    whole = eqx_offload.offloaded(optax.adam(1e-2), group_bytes=None, **options)
    a, b = sliced.init(params), whole.init(params)
    for g in grads:
        ua, a = jax.jit(sliced.update)(g, a)
        ub, b = jax.jit(whole.update)(g, b)
        assert_tree_equal((ua, a.inner_state), (ub, b.inner_state))
    return a


def _bitwise_the_unwrapped(ref: Any, opt: Any, params: Any, grads: list[Any]) -> None:
    """`opt` (an `offloaded(ref)`) jitted: bitwise `ref`'s updates and state at every
    step, its state placed as the layout says."""
    ref_state, state = ref.init(params), opt.init(params)
    for g in grads:
        ref_updates, ref_state = jax.jit(ref.update)(g, ref_state, params)
        updates, state = jax.jit(opt.update)(g, state, params)
        assert_tree_equal((updates, state.inner_state), (ref_updates, ref_state))
        assert_placed(state)

"""The streamed update's analysis (`_stream/schedule.py`), on traced programs only: the groups
it plans and the updates it refuses to stream, naming the coupling."""

from typing import Any

import jax
import numpy as np
import optax
import pytest
from helpers import committed, make_grads, make_params
from helpers import REJECTED_STREAMING

import eqx_offload


@pytest.mark.parametrize("name", list(REJECTED_STREAMING))
def test_streaming_rejects_coupled_state(name: str) -> None:
    """An update that couples the state of several leaves is refused, naming where."""
    params = make_params()
    opt = eqx_offload.offloaded(REJECTED_STREAMING[name](), group_bytes=0)
    state = opt.init(params)
    with pytest.raises(eqx_offload.errors.CompositionError, match="cannot be streamed") as info:
        jax.jit(opt.update)(make_grads(params, 0), state, params)
    message = str(info.value)
    assert "couples the state of" in message and "the coupling is made by `" in message


def test_streaming_rejects_side_effects() -> None:
    """A side effect in the update cannot be split into groups: refused."""
    def print_update(updates: Any, state: Any, params: Any = None) -> Any:
        jax.debug.print("{}", jax.tree.leaves(updates)[0].sum())
        return updates, state

    printing = optax.GradientTransformation(lambda p: optax.EmptyState(), print_update)
    opt = eqx_offload.offloaded(optax.chain(optax.adam(1e-2), printing), group_bytes=0)
    params = make_params()
    with pytest.raises(eqx_offload.errors.CompositionError, match="side effects"):
        jax.jit(opt.update)(make_grads(params, 0), opt.init(params), params)


def test_stream_plan_groups() -> None:
    params = {f"p{i}": committed(np.ones((16, 16))) for i in range(4)}  # adam state: 2 KiB each
    opt = eqx_offload.offloaded(optax.adam(1e-3), group_bytes=0)
    inner_state = opt.init(params).inner_state

    def plan(group_bytes: int) -> eqx_offload.stream.StreamPlan:
        return eqx_offload.stream.stream_plan(optax.adam(1e-3), params, inner_state, params,
                                       group_bytes=group_bytes)

    finest = plan(0)
    # In reverse leaf order: the order the backward pass produces the gradients.
    assert finest.groups == tuple((f"0/mu/p{i}", f"0/nu/p{i}") for i in reversed(range(4)))
    assert finest.group_nbytes == (2048,) * 4
    assert finest.max_group_nbytes == 2048 and finest.total_nbytes == 8192
    assert finest.prologue == () and finest.resident == ("0/count",)
    pairs = plan(4096)
    assert pairs.groups == (("0/mu/p2", "0/mu/p3", "0/nu/p2", "0/nu/p3"),
                            ("0/mu/p0", "0/mu/p1", "0/nu/p0", "0/nu/p1"))
    assert plan(4095).group_nbytes == (2048,) * 4
    assert plan(1 << 30).group_nbytes == (8192,)
    # "auto" (offloaded's default): about 1/16 of the streamed state, so here one
    # parameter's state per group (8 KiB / 16 = 512 B, below one unit).
    assert eqx_offload.stream.stream_plan(optax.adam(1e-3), params, inner_state, params) == finest


def test_plan_prologue_when_counter_is_offloaded() -> None:
    """State read by every group (Adam's count, a 0-d moment) comes in first, whole
    (the streamed run of this: test_equivalence.py, `streamed_where_true`)."""
    params = make_params()
    state = eqx_offload.offloaded(optax.adam(1e-2), where=True, group_bytes=0).init(params)
    assert state.inner_state[0].count.sharding.memory_kind == "pinned_host"
    plan = eqx_offload.stream.stream_plan(optax.adam(1e-2), params, state.inner_state, group_bytes=0)
    assert "0/count" in plan.prologue and "0/mu/scale" in plan.prologue


def test_stacked_pieces_take_turns() -> None:
    """The pieces of a stack's leaves take turns, one piece of each in turn, after the
    stack's leaves smaller than a group (consecutive groups then write one leaf's host
    buffer while reading another's); a leaf larger than a group that cannot be split
    keeps its place, and so does a lone split leaf."""
    params = {"a": committed(np.ones((16, 16))),  # whole, larger than a group
              "b": committed(np.ones((4, 8, 8))),  # split: 512 B of state a row
              "c": committed(np.ones((4, 8))),  # a stack's small leaf
              "d": committed(np.ones((4, 8, 8)))}  # split
    state = eqx_offload.offloaded(optax.adam(1e-3), group_bytes=1280).init(params).inner_state
    plan = eqx_offload.stream.stream_plan(optax.adam(1e-3), params, state, params,
                                          group_bytes=1280)
    assert plan.groups == (
        ("0/mu/c", "0/mu/d[0:2]", "0/nu/c", "0/nu/d[0:2]"),
        ("0/mu/b[0:2]", "0/nu/b[0:2]"),
        ("0/mu/d[2:4]", "0/nu/d[2:4]"),
        ("0/mu/b[2:4]", "0/nu/b[2:4]"),
        ("0/mu/a", "0/nu/a"))
    assert plan.group_nbytes == (1280, 1024, 1024, 1024, 2048)
    alone = {k: params[k] for k in "abc"}
    state = eqx_offload.offloaded(optax.adam(1e-3), group_bytes=1280).init(alone).inner_state
    plan = eqx_offload.stream.stream_plan(optax.adam(1e-3), alone, state, alone, group_bytes=1280)
    assert plan.groups == (("0/mu/b[0:2]", "0/mu/c", "0/nu/b[0:2]", "0/nu/c"),
                           ("0/mu/b[2:4]", "0/nu/b[2:4]"), ("0/mu/a", "0/nu/a"))

"""Real programs ported with the README's three-line change, and the optax idioms they
use (issue 10).

- Small Equinox training programs (`tests/ports/`), each run as written and ported
    (`import eqx_offload`, `offloaded(...)` around the optimizer,
    `eqx_offload.filter_jit` around the step): losses, final model and inner optimizer
    state bitwise equal; every offloaded state leaf in `pinned_host` (0-d counters on
    the device) after every step; no compilation after the first step.
- Reading a state the optax way: `hyperparams[...]` (read and write),
    `optax.tree.get`/`set`, `schedule_free_eval_params`, `MultiSteps.has_updated`.
- Every transformation of the installed optax that takes extra `update` arguments
    (found by calling each one without them), wrapped and composed, in each mode.
- States that hold Python scalars, or change structure in `update`.
- `eqx.filter_pmap`.

Tests marked `xfail(strict=True, reason="issue 10 item N: ...")` pin what the library
gets wrong today; each flips to a failure when it is fixed, to be unmarked.
"""

import functools
import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import optax.contrib
import pytest
from helpers import assert_tree_equal
from isolated import call_isolated
from ports import batchnorm, data_parallel, frozen, nonarray, rnn
from ports.common import compilations, expected_placement, Run, unwrap

import eqx_offload


def _raw(tree: Any) -> Any:
    """Typed PRNG keys as their key data, so bitwise comparison sees their bits."""
    return jtu.tree_map(
        lambda x: jax.random.key_data(x)
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
        else x,
        tree,
    )


def _assert_bitwise(a: Any, b: Any) -> None:
    assert_tree_equal(_raw(a), _raw(b))


def _assert_same_run(plain: Run, ported: Run) -> None:
    """Bitwise equal losses, model, inner state and extras; the ported state in host
    memory after every step; no compilation after the first ported step."""
    assert len(plain.losses) == len(ported.losses) >= 4
    assert len({np.asarray(x).tobytes() for x in plain.losses}) > 1, "it does not train"
    _assert_bitwise(plain.losses, ported.losses)
    _assert_bitwise(plain.model, ported.model)
    _assert_bitwise(plain.opt_state, unwrap(ported.opt_state))
    _assert_bitwise(plain.extra, ported.extra)
    expected = expected_placement(ported.opt_state)
    assert "pinned_host" in expected.values()
    assert not plain.placements and len(ported.placements) == len(ported.losses)
    for kinds in ported.placements:
        assert kinds == expected
    # (Not asserted for the plain run: `eqx.filter_jit` compiles twice when optax's
    # `init` returns uncommitted arrays and the step commits them, upstream behaviour.)
    assert ported.compiles[1:] == [0] * (len(ported.compiles) - 1), ported.compiles


def test_compilation_counter_counts() -> None:
    # The counter `Run.compiles` is made of sees a compilation (so the "no compilation
    # after the first step" checks can fail).
    x = jnp.arange(5.0)
    before = compilations()
    jax.jit(lambda x: x * 3 + 1)(x)
    assert compilations() - before == 1


# ---------------------------------------------------------------------------------------
# The programs

PROGRAMS: dict[str, Callable[..., Run]] = {
    "rnn_scan": rnn.train,
    "batchnorm_state": batchnorm.train,
    "frozen_partition": frozen.train_partition,
    "frozen_multi_transform": frozen.train_multi_transform,
    "non_array_leaves": nonarray.train,
    "data_parallel_device_put": functools.partial(data_parallel.train, idioms=()),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_port_bitwise(name: str) -> None:
    program = PROGRAMS[name]
    _assert_same_run(program(False), program(True))


_ITEM3_SHARD = (
    "issue 10 item 3: eqx.filter_shard on an offloaded state fails (eagerly: the state "
    "from offloaded(...).init is committed to device 0, 'incompatible devices'; inside "
    "filter_jit: CompositionError for sharding_constraint, a placement)"
)


@pytest.mark.parametrize(
    "idioms",
    [
        pytest.param(("eager",), marks=pytest.mark.xfail(
            strict=True, raises=ValueError, reason=_ITEM3_SHARD)),
        pytest.param(("in_step",), marks=pytest.mark.xfail(
            strict=True, raises=eqx_offload.CompositionError, reason=_ITEM3_SHARD)),
        pytest.param(("eager", "in_step"), marks=pytest.mark.xfail(
            strict=True, raises=ValueError, reason=_ITEM3_SHARD)),
    ],
    ids=["eager", "in_step", "eager+in_step"],
)
def test_port_filter_shard(idioms: tuple[str, ...]) -> None:
    # Equinox's parallelism example: `filter_shard((model, opt_state), replicated)`
    # eagerly after `init` and inside the step. The offloaded state must follow the
    # replicated sharding onto the 4 devices and stay in host memory.
    plain = data_parallel.train(False, idioms)
    ported = data_parallel.train(True, idioms)
    _assert_same_run(plain, ported)
    mesh_devices = set(data_parallel.mesh().devices.flat)
    for leaf in jtu.tree_leaves(ported.opt_state):
        if leaf.ndim >= 1:
            assert leaf.sharding.device_set == mesh_devices
            assert leaf.sharding.is_fully_replicated


def test_port_data_parallel_state_follows_params() -> None:
    # Without filter_shard (params replicated with `jax.device_put`), `init` gives each
    # state leaf its parameter's sharding: on the 4 devices, replicated, in host memory.
    ported = data_parallel.train(True, ())
    mesh_devices = set(data_parallel.mesh().devices.flat)
    offloaded = [x for x in jtu.tree_leaves(ported.opt_state) if x.ndim >= 1]
    assert offloaded
    for leaf in offloaded:
        assert leaf.sharding.memory_kind == "pinned_host"
        assert leaf.sharding.device_set == mesh_devices


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="issue 10 item 3: under eqx.filter_pmap the offloaded state silently stays in "
    "device memory (an OffloadWarning at the first update), neither offloaded nor "
    "refused with an OffloadError",
)
def test_port_filter_pmap() -> None:
    # Either it works (bitwise equal, the per-replica state in host memory between
    # steps), or `offloaded` refuses with an OffloadError that names what to use.
    plain = data_parallel.train_pmap(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", eqx_offload.OffloadWarning)
            ported = data_parallel.train_pmap(True)
    except eqx_offload.OffloadError as error:
        assert re.search(r"filter_jit|filter_shard|shard", str(error)), error
        return
    except eqx_offload.OffloadWarning as warning:
        raise AssertionError(f"the state was not offloaded: {warning}") from None
    _assert_bitwise(plain.losses, ported.losses)
    _assert_bitwise(plain.model, ported.model)
    _assert_bitwise(plain.opt_state, unwrap(ported.opt_state))
    for kinds in ported.placements:
        # Per replica, the moments (1-d and up) are offloaded and the count (0-d) is not.
        assert sorted(set(kinds.values())) == ["device", "pinned_host"], kinds


def donated_child() -> dict[str, Any]:
    """Every program, plain and ported, with `donate="all"`: the first difference (or
    None) and whether the ported placements were right, per program."""
    out = {}
    for name, program in sorted(PROGRAMS.items()):
        plain, ported = program(False, donate="all"), program(True, donate="all")
        try:
            _assert_same_run(plain, ported)
            out[name] = None
        except AssertionError as error:
            out[name] = str(error)[:2000]
    return out


@pytest.mark.slow
def test_ports_donated() -> None:
    # The README's recommended `donate="all"`, in a fresh process (a donation bug would
    # abort it): every program still bitwise equal, the state in host memory.
    results = call_isolated(donated_child)
    assert set(results) == set(PROGRAMS)
    assert results == {name: None for name in PROGRAMS}

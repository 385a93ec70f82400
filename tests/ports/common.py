"""What every ported program returns, and the checks `tests/test_ports.py` runs on it.

Each program in this folder is a small Equinox training script written the way users
write them, with one switch, `port`: `False` runs it as written (`eqx.filter_jit`,
plain optax); `True` applies the README's three-line change (`import eqx_offload`,
`eqx_offload.offloaded(...)` around the optimizer, `eqx_offload.filter_jit` around the
step). Nothing else differs between the two runs.
"""

import contextlib
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

import eqx_offload

from helpers import count_compiles


class Run(NamedTuple):
    """The result of one training run.

    - `losses`: the loss of every step (device arrays, compared bitwise).
    - `model`: the final model (arrays and static fields).
    - `opt_state`: the final optimizer state (an `OffloadedState` when ported).
    - `placements`: for a ported run, after every step, `{path: memory kind}` of every
        array leaf of the inner state; empty for a plain run.
    - `compiles`: how many XLA compilations each step triggered (`helpers.count_compiles`).
    - `extra`: anything else the program wants compared (e.g. an `eqx.nn.State`).
    """

    losses: list[Any]
    model: Any
    opt_state: Any
    placements: list[dict[str, str]]
    compiles: list[int]
    extra: Any = None


class Recorder:
    """What every program records per step: the loss, the compilations the step caused,
    and (ported) where each state leaf lives after it."""

    def __init__(self, port: bool) -> None:
        self.port = port
        self.losses: list[Any] = []
        self.placements: list[dict[str, str]] = []
        self.compiles: list[int] = []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        with count_compiles() as compiled:
            yield
        self.compiles.append(len(compiled))

    def record(self, loss: Any, opt_state: Any) -> None:
        self.losses.append(loss)
        if self.port:
            self.placements.append(placement(opt_state))

    def run(self, model: Any, opt_state: Any, extra: Any = None) -> Run:
        return Run(self.losses, model, opt_state, self.placements, self.compiles, extra)


def _array_leaves(opt_state: Any) -> Iterator[tuple[str, jax.Array, bool]]:
    """`(path, leaf, inside an OffloadedState?)` for every `jax.Array` leaf of
    `opt_state` (`offloaded` may sit anywhere in it; paths name `.inner_state`)."""

    def visit(tree: Any, prefix: str, inside: bool) -> Iterator[tuple[str, jax.Array, bool]]:
        leaves = jtu.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, eqx_offload.OffloadedState)
        )[0]
        for path, leaf in leaves:
            name = prefix + jtu.keystr(path)
            if isinstance(leaf, eqx_offload.OffloadedState):
                yield from visit(leaf.inner_state, name + ".inner_state", True)
            elif isinstance(leaf, jax.Array):
                yield name, leaf, inside

    return visit(opt_state, "", False)


def placement(opt_state: Any) -> dict[str, str]:
    """`{path: memory kind}` of every array leaf of `opt_state`."""
    return {name: leaf.sharding.memory_kind for name, leaf, _ in _array_leaves(opt_state)}


def expected_placement(opt_state: Any) -> dict[str, str]:
    """What `placement` must be with `offloaded`'s default `where`: every leaf with at
    least one dimension in `pinned_host`, except a line search's `grad`; 0-d leaves
    (step counters) on the device; leaves outside any `OffloadedState` on the device,
    and the accumulator of `offloaded(MultiSteps(...))` (`acc_grads`, kept on the
    device by design)."""
    return {
        name: "pinned_host" if inside and np.ndim(leaf) >= 1 and "acc_grads" not in name
        and not re.search(r"\.grad(\[|$)", name) else "device"
        for name, leaf, inside in _array_leaves(opt_state)
    }


def unwrap(tree: Any) -> Any:
    """`tree` with every `OffloadedState(x)` replaced by `x`."""
    return jtu.tree_map(
        lambda x: unwrap(x.inner_state) if isinstance(x, eqx_offload.OffloadedState) else x,
        tree,
        is_leaf=lambda x: isinstance(x, eqx_offload.OffloadedState),
    )


def params(model: Any) -> Any:
    """The arrays of a model (what the optimizer sees)."""
    return eqx.filter(model, eqx.is_array)

"""What every ported program returns and records.

Each program here is a training script written the way users write them, with one switch,
`port`: `False` runs it as written, `True` with the README's three-line change (`import
eqx_offload`, `offloaded(...)` around the optimizer, `eqx_offload.filter_jit` around the
step). Nothing else differs between the two runs.
"""

import contextlib
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

import eqx_offload

from helpers import count_compiles


class Run(NamedTuple):
    """One training run: per-step losses, final model and state, per-step `{path: memory
    kind}` (ported runs only), per-step compilations, and anything else to compare."""

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
    """`(path, leaf, inside an OffloadedState?)` for every `jax.Array` leaf of `opt_state`."""

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
    """`placement` under `offloaded`'s default `where`: leaves with a dimension in
    `pinned_host`; on the device 0-d leaves, a line search's `grad`, `MultiSteps`'
    `acc_grads` (by design) and leaves outside any `OffloadedState`."""
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


def fresh_copy(tree: Any) -> Any:
    """`tree` with fresh buffers but the same `StateIndex` markers (models built per run
    would never have equal tree structures: each `StateIndex` has its own marker)."""
    return jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree)

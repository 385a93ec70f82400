"""What every ported program returns and records. Each program runs as written
(`port=False`) or with the README's three-line change (`port=True`), nothing else."""

import contextlib
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

import eqx_offload

from helpers import count_compiles


class Run(NamedTuple):
    """Per-step losses, final model and state, per-step `{path: memory kind}` (ported
    runs only) and compilations, and anything else to compare."""

    losses: list[Any]
    model: Any
    opt_state: Any
    placements: list[dict[str, str]]
    compiles: list[int]
    extra: Any = None


class Recorder:
    """Records per step the loss, the compilations and (ported) the state's placement."""

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
        is_state = lambda x: isinstance(x, eqx_offload.OffloadedState)  # noqa: E731
        for path, leaf in jtu.tree_flatten_with_path(tree, is_leaf=is_state)[0]:
            name = prefix + jtu.keystr(path)
            if is_state(leaf):
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
    `acc_grads` and leaves outside any `OffloadedState`."""
    return {
        name: "pinned_host" if inside and np.ndim(leaf) >= 1 and "acc_grads" not in name
        and not re.search(r"\.grad(\[|$)", name) else "device"
        for name, leaf, inside in _array_leaves(opt_state)
    }


def params(model: Any) -> Any:
    """The arrays of a model (what the optimizer sees)."""
    return eqx.filter(model, eqx.is_array)


def sin_product(x: jax.Array) -> jax.Array:
    return jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1)


def batches(key: jax.Array, steps: int, shape: tuple[int, ...], target: Any = sin_product,
            transform: Any = None) -> list[tuple[jax.Array, jax.Array]]:
    """`steps` batches `(x, target(x))`, `x` standard normal of `shape` (through `transform`)."""
    xs = [jr.normal(k, shape) for k in jr.split(key, steps)]
    xs = xs if transform is None else [transform(x) for x in xs]
    return [(x, target(x)) for x in xs]


def fresh_copy(tree: Any) -> Any:
    """`tree` with fresh buffers but the same `StateIndex` markers (so that two runs'
    trees have equal structures)."""
    return jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree)

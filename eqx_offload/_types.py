"""Public type aliases of `eqx_offload`.

`Nested[T]` is the recursive container type that optimizer states are made of: dicts,
lists and tuples (which include `NamedTuple`s such as `optax.ScaleByAdamState`) of `T`.
"""

from collections.abc import Callable
from typing import Any, Literal, TypeVar, Union

import equinox as eqx


_T = TypeVar("_T")

# A recursive alias. `tuple` covers every `NamedTuple` (optax states are NamedTuples),
# which a dict-only nested type (axlearn's) could not express.
Nested = Union[
    _T,
    dict[Any, "Nested[_T]"],
    list["Nested[_T]"],
    tuple["Nested[_T]", ...],
]

MemoryKind = Literal["device", "pinned_host", "unpinned_host"]
"""Every memory kind a JAX device may offer."""

HostMemoryKind = Literal["pinned_host", "unpinned_host"]
"""The memory kinds that `to_host` and `offloaded` can move state to."""

Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]
"""The donation modes of `eqx_offload.filter_jit` (the same as `equinox.filter_jit`)."""

LeafFilter = Callable[[Any], bool]
"""A callable on one leaf, as in an Equinox filter spec."""

WhereLeaf = Union[bool, LeafFilter]
"""What may stand at a leaf of a `where` prefix tree."""

Where = Union[WhereLeaf, Nested[WhereLeaf], eqx.Module]
"""An Equinox-style filter spec: a bool, a callable on a leaf (including the path-aware
filters `pattern`, `min_bytes` and `min_ndim`), or a pytree prefix of the tree whose leaves
are those. An `eqx.Module` prefix (e.g. built with `jax.tree.map` from a model) is allowed."""

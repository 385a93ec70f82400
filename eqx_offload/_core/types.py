"""Public type aliases of `eqx_offload`.

`Nested[T]` is the recursive container type that optimizer states are made of: dicts
(any `Mapping`), lists and tuples (which include `NamedTuple`s such as
`optax.ScaleByAdamState`) of `T`.
"""

from collections.abc import Callable, Mapping
from typing import Any, Literal, TYPE_CHECKING, TypeVar, Union

import equinox as eqx
import jax


_T = TypeVar("_T")

if TYPE_CHECKING:
    # A recursive alias, for mypy and pytype. `tuple` covers every `NamedTuple` (optax
    # states are NamedTuples), which a dict-only nested type (axlearn's) could not
    # express. `Mapping` rather than `dict`: `Mapping` is covariant in its values, so
    # a `dict[str, jax.Array]` variable is a `Nested[jax.Array]` (a `dict[...]` arm
    # would reject it, `dict` being invariant).
    Nested = Union[
        _T,
        Mapping[Any, "Nested[_T]"],
        list["Nested[_T]"],
        tuple["Nested[_T]", ...],
    ]
else:
    # At run time (beartype through jaxtyping's import hook) the alias is the same union
    # unrolled `_RUNTIME_DEPTH` levels deep, ending in `Any`. A string forward reference
    # ("Nested[_T]") cannot be used here: it is resolved in the namespace of the
    # function being checked (`eqx_offload._core.move`, or the user's module), where
    # `Nested` is usually not defined, and jaxtyping then silently checks nothing
    # (it replaces an annotation it cannot resolve by `Any`). Unrolled, `Nested[T]`
    # substitutes `T` at every level, and beartype checks one random item per level.
    # Two levels keep beartype's error message readable (it prints the whole union);
    # deeper mistakes in a `where` are caught by `leaf_mask` (a `WhereError` with the
    # path).
    _RUNTIME_DEPTH = 2

    def _unrolled(depth: int) -> Any:
        inner = Any if depth == 1 else _unrolled(depth - 1)
        return Union[_T, Mapping[Any, inner], list[inner], tuple[inner, ...]]

    Nested = _unrolled(_RUNTIME_DEPTH)

if TYPE_CHECKING:
    # `jax.Device` is a variable (an alias of jaxlib's class), which pyright refuses in
    # annotations; the checkers see `Any` here, the runtime checks the real class.
    Device = Any
else:
    Device = jax.Device

MemoryKind = Literal["device", "pinned_host", "unpinned_host"]
"""Every memory kind a JAX device may offer."""

HostMemoryKind = Literal["pinned_host", "unpinned_host"]
"""The memory kinds that `to_host` and `offloaded` can move state to."""

Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]
"""The donation modes of `eqx_offload.filter_jit` (the same as `equinox.filter_jit`)."""

LeafFilter = Callable[[Any], bool]
"""A callable on one leaf, as in an Equinox filter spec."""

WhereLeaf = Union[bool, LeafFilter, eqx.Module, None]
"""What may stand at a leaf of a `where` prefix tree: a bool, a callable on a leaf, an
`eqx.Module` whose fields are those (a prefix built from a model), or `None` where the
tree has `None` (an empty subtree, as in every JAX pytree)."""

Where = Nested[WhereLeaf]
"""An Equinox-style filter spec: a bool, a callable on a leaf (including the path-aware
filters `pattern`, `min_bytes` and `min_ndim`), or a pytree prefix of the tree whose leaves
are those: dicts, lists, tuples and `eqx.Module`s (e.g. built with `jax.tree.map` from a
model), with `None` where the tree has `None`."""

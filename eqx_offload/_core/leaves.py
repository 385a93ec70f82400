"""How `eqx_offload` names and measures the leaves of a pytree.

One path convention for the whole package: a leaf's key path as `/`-joined keys from the
root (`"1/0/mu/layers/0/weight"`: dict keys, sequence indices, attribute names), the form
`pattern` matches, errors print and `memory_report` lists. `paths_parts` gives paths
as tuples, which `filter_jit` compares from the end to pair outputs with inputs.
`format_bytes` is how every message and report prints a size.
"""

from collections.abc import Sequence
from typing import Any, Union

import jax
import jax.core
import jax.tree_util as jtu
import numpy as np


KeyPath = tuple[Any, ...]


def key_to_str(key: Any) -> str:
    """One entry of a JAX key path as it appears in a path string."""
    if isinstance(key, jtu.SequenceKey):
        return str(key.idx)
    if isinstance(key, jtu.DictKey):
        return str(key.key)
    if isinstance(key, jtu.GetAttrKey):
        return str(key.name)
    if isinstance(key, jtu.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def paths_parts(paths: Sequence[KeyPath]) -> list[tuple[str, ...]]:
    """Each key path as a tuple of strings, e.g. `("1", "0", "mu", "weight")`."""
    return [tuple(map(key_to_str, path)) for path in paths]


def path_to_str(path: KeyPath) -> str:
    """A key path as a `/`-separated string, e.g. `"1/0/mu/layers/0/weight"` (the form
    that axlearn's `pattern` matches against)."""
    return "/".join(map(key_to_str, path))


def call_argument(path: KeyPath) -> tuple[Union[int, str], str]:
    """Of a key path into a call's `(args, kwargs)`: the positional argument's index or
    the keyword argument's name, and the leaf's path inside that argument
    (`jtu.keystr`, or `"(the argument itself)"`), as errors name them."""
    kind, key, rest = path[0], path[1], tuple(path[2:])
    argument: Union[int, str] = (getattr(key, "idx", 0) if getattr(kind, "idx", 0) == 0
                                 else str(getattr(key, "key", key)))
    return argument, jtu.keystr(rest) or "(the argument itself)"

def shown(path: str) -> str:
    """A path string as errors print it (`<root>` for the root itself)."""
    return path or "<root>"


def nbytes(leaf: Any) -> int:
    """Bytes of an array leaf (its global size, for a sharded array). `dtype.itemsize`,
    not `np.dtype(...)`: JAX's extended dtypes (typed PRNG keys) are no NumPy dtypes."""
    return int(np.prod(leaf.shape, dtype=np.int64)) * int(leaf.dtype.itemsize)


def is_traced(x: Any) -> bool:
    """Whether `x` is a tracer (inside `jit`, `grad`, `vmap`, ...)."""
    return isinstance(x, jax.core.Tracer)


def is_none(x: Any) -> bool:
    """`is_leaf` for a tree map that pairs `None` (no update, no gradient) with a
    subtree."""
    return x is None


def format_bytes(n: Union[int, float]) -> str:
    """`1536` -> `"1.5 KiB"`. (`int` spelled out: beartype, unlike mypy, does not
    accept an `int` for `float`.)"""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

"""`where` filter specs: resolving them against a tree, and the path-aware helpers."""

import dataclasses
import functools
import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any, cast, Optional

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from .errors import (OffloadWarning, selects_nothing_message, where_dtype_error, where_result_error,
                      where_signature_error, WhereError)
from .leaves import is_traced, KeyPath, nbytes, path_to_str, shown


class Filter:
    """Base class of the path-aware filters (`pattern`, `min_bytes`, `min_ndim`).

    A `Filter` is a callable on a leaf, so it stands anywhere an Equinox filter callable
    may; `eqx_offload` also passes it the leaf's path. Filters combine with `&`, `|`
    and `~`.
    """

    def __call__(self, leaf: Any, path: str = "") -> bool:
        raise NotImplementedError

    def __and__(self, other: Callable[[Any], bool]) -> "Filter":
        return _AllOf((self, _as_filter(other))) if callable(other) else NotImplemented

    def __rand__(self, other: Callable[[Any], bool]) -> "Filter":
        return _AllOf((_as_filter(other), self)) if callable(other) else NotImplemented

    def __or__(self, other: Callable[[Any], bool]) -> "Filter":
        return _AnyOf((self, _as_filter(other))) if callable(other) else NotImplemented

    def __ror__(self, other: Callable[[Any], bool]) -> "Filter":
        return _AnyOf((_as_filter(other), self)) if callable(other) else NotImplemented

    def __invert__(self) -> "Filter":
        return _Not(self)


@dataclasses.dataclass(frozen=True)
class pattern(Filter):  # noqa: N801 - lower case like a function, as axlearn's `pattern`
    """Selects leaves whose path fully matches a regular expression.

    Paths join the keys from the root with `/`: dict keys, sequence indices and
    attribute names (NamedTuple fields, `eqx.Module` fields). The state of
    `optax.chain(clip, adam)` has its first moments at `"1/0/mu/<param path>"`; inside
    `offloaded` the paths are those of the inner state.

    **Arguments:**

    - `regex`: a regular expression, matched with `re.fullmatch` (axlearn's `pattern`
        semantics), e.g. `".*/mu/.*"` or `".*(mu|nu)/.*"`.

    !!! Example

        ```python
        import jax.numpy as jnp
        import eqx_offload
        tree = {"mu": {"w": jnp.ones(3)}, "count": jnp.zeros((), "int32")}
        out = eqx_offload.to_host(tree, where=eqx_offload.pattern("mu/.*"))
        assert out["mu"]["w"].sharding.memory_kind == "pinned_host"
        assert out["count"].sharding.memory_kind == "device"
        ```
    """

    regex: str

    def __post_init__(self) -> None:
        try:
            re.compile(self.regex)
        except re.error as e:
            raise WhereError(f"pattern(regex={self.regex!r}) is not a valid regular "
                             f"expression: {e}.") from e

    def __call__(self, leaf: Any, path: str = "") -> bool:
        return re.fullmatch(self.regex, path) is not None


@dataclasses.dataclass(frozen=True)
class min_bytes(Filter):  # noqa: N801
    """Selects array leaves of at least `nbytes` bytes (torchao's `minimal_size`):
    offloading a 4-byte step counter is pure overhead.

    **Arguments:**

    - `nbytes`: the smallest size, in bytes, of a leaf that is selected.
    """

    nbytes: int

    def __call__(self, leaf: Any, path: str = "") -> bool:
        return eqx.is_array(leaf) and nbytes(leaf) >= self.nbytes


@dataclasses.dataclass(frozen=True)
class min_ndim(Filter):  # noqa: N801
    """Selects array leaves with at least `ndim` dimensions. `min_ndim(1)` (every array
    but 0-d scalars such as step counters) is the default of `offloaded`.

    **Arguments:**

    - `ndim`: the smallest number of dimensions of a leaf that is selected.
    """

    ndim: int

    def __call__(self, leaf: Any, path: str = "") -> bool:
        return eqx.is_array(leaf) and leaf.ndim >= self.ndim


@dataclasses.dataclass(frozen=True)
class _OnLeaf(Filter):
    """A plain callable on a leaf (an Equinox filter) inside a combination."""

    fn: Callable[[Any], Any]

    def __call__(self, leaf: Any, path: str = "") -> bool:
        return _flag(self.fn, self.fn(leaf), "where", path)


def _as_filter(f: Callable[[Any], Any]) -> Filter:
    if isinstance(f, Filter):
        return f
    _check_leaf_callable("where", f, "<root>")
    return _OnLeaf(f)


def _is_dtype(x: Any) -> bool:
    """`jnp.float32`, `np.float32`, `np.dtype("float32")`: a dtype, not a filter."""
    return isinstance(x, np.dtype) or (isinstance(x, type) and (
        issubclass(x, np.generic) or isinstance(getattr(x, "dtype", None), np.dtype)))


def _check_leaf_callable(argument: str, fn: Callable[..., Any], at: str) -> None:
    """A `where` callable is called with one leaf: refuse a dtype or a callable of
    another arity (`lambda path, leaf: ...`) with the fix, before it is called."""
    if _is_dtype(fn):
        raise where_dtype_error(argument, fn, at)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: call it and see
        return
    try:
        signature.bind(None)
    except TypeError:
        raise where_signature_error(argument, fn, at, _takes(signature)) from None


def _takes(signature: inspect.Signature) -> str:
    """What a callable that cannot be called with one argument takes, in words."""
    params = list(signature.parameters.values())
    required = [p for p in params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if any(p.kind is p.KEYWORD_ONLY for p in required):
        return "a required keyword-only argument"
    if len(required) > 1:
        return f"{len(required)} arguments"
    return "no positional argument" if params else "no argument"


def _flag(fn: Callable[..., Any], result: Any, argument: str, path: str) -> bool:
    """A `where` callable's answer for one leaf: anything with a truth value (a bool, a
    NumPy or concrete JAX boolean), not a traced value (no truth value under `jit`) or
    an array of several elements (none either)."""
    if is_traced(result) or (eqx.is_array(result) and result.size != 1):
        raise where_result_error(argument, fn, result, shown(path))
    return bool(result)


@dataclasses.dataclass(frozen=True)
class _AllOf(Filter):
    parts: tuple[Filter, ...]

    def __call__(self, leaf: Any, path: str = "") -> bool:
        return all(p(leaf, path) for p in self.parts)


@dataclasses.dataclass(frozen=True)
class _AnyOf(Filter):
    parts: tuple[Filter, ...]

    def __call__(self, leaf: Any, path: str = "") -> bool:
        return any(p(leaf, path) for p in self.parts)


@dataclasses.dataclass(frozen=True)
class _Not(Filter):
    part: Filter

    def __call__(self, leaf: Any, path: str = "") -> bool:
        return not self.part(leaf, path)


def _is_spec_leaf(x: Any) -> bool:
    # A callable that is itself a pytree node (a Flax NNX `Variable`, an `eqx.Module`
    # with a `__call__`) is part of the spec's structure, not a filter: a mask rebuilt
    # as a tree over an NNX state holds `Variable(True)`, which must be walked into,
    # never called.
    return isinstance(x, bool) or (callable(x) and not isinstance(x, eqx.Module)
                                   and _is_pytree_leaf(x))


def _is_pytree_leaf(x: Any) -> bool:
    treedef: Any = jtu.tree_structure(x)  # (`PyTreeDef` is untyped for mypy)
    return bool(treedef.num_nodes == 1 and treedef.num_leaves == 1)


@dataclasses.dataclass(frozen=True, eq=False)
class Selection(Filter):
    """A selection already resolved against one tree: one flag per leaf of
    `jax.tree.leaves(tree)`, as `leaf_mask` returns it.

    Internal: `offloaded` resolves its `where` once per state and hands the flat result
    to the moves (`Options.store`, `move`) as a `where`, so the mask is never rebuilt as
    a tree and read again as a filter spec (a tree of masks over an NNX state holds
    callable `Variable`s). `leaf_mask` returns the flags as they are, after checking
    that they are as many as the tree's leaves."""

    flags: tuple[bool, ...]

    def __call__(self, leaf: Any, path: str = "") -> bool:
        raise WhereError(
            "An internal selection (one flag per leaf of a whole tree) was used as a "
            "filter on one leaf; it can only stand for a whole `where`."
        )


def select(mask: list[bool]) -> Selection:
    """`mask` (from `leaf_mask`) as a `where` for the same tree."""
    return Selection(tuple(mask))


def _is_not(tree: Any, x: Any) -> bool:
    return x is not tree


def _one_level(tree: Any) -> tuple[Any, list[tuple[KeyPath, Any]]]:
    """The node data of `tree`'s root and its children with their keys."""
    children, treedef = jtu.tree_flatten_with_path(tree, is_leaf=functools.partial(_is_not, tree))
    return cast(Any, treedef).node_data(), children  # (not in jaxlib's type stubs)


def structure_divergence(
    prefix: Any, tree: Any, is_leaf: Callable[[Any], bool] = lambda _: False
) -> Optional[tuple[str, str]]:
    """Where `prefix` stops being a pytree prefix of `tree`.

    Returns `None` if it is a prefix (every `is_leaf` node of `prefix` stands on some
    subtree of `tree`), else the path where they diverge and a description."""
    structure: Any = jtu.tree_structure(prefix)  # (`PyTreeDef` is typed without `__eq__`)
    if structure == jtu.tree_structure(tree):  # (the usual answer, at once)
        return None
    return _divergence(prefix, tree, (), is_leaf)


def _divergence(
    a: Any, b: Any, path: KeyPath, is_leaf: Callable[[Any], bool]
) -> Optional[tuple[str, str]]:
    if is_leaf(a):
        return None
    a_data, a_children = _one_level(a)
    b_data, b_children = _one_level(b)
    if a_data is None and b_data is None:
        return None
    if a_data != b_data or len(a_children) != len(b_children):
        return (
            shown(path_to_str(path)),
            f"{_describe(a)} where the tree has {_describe(b)}",
        )
    for (ka, ca), (_, cb) in zip(a_children, b_children):
        found = _divergence(ca, cb, path + ka, is_leaf)
        if found is not None:
            return found
    return None


def _describe(node: Any) -> str:
    data, children = _one_level(node)
    if data is None:
        return f"leaf {node!r}" if not eqx.is_array(node) else f"array {node.dtype}{list(node.shape)}"
    if node is None:
        return "None"
    kind, aux = data
    name = getattr(kind, "__name__", str(kind))
    if isinstance(node, dict):
        return f"dict with keys {sorted(map(str, node))}"
    described = f"{name} with {len(children)} children"
    if isinstance(node, eqx.Module):
        fields = dataclasses.fields(cast(Any, node))  # a Module is a dataclass
        static = {f.name: getattr(node, f.name, None) for f in fields
                  if f.metadata.get("static", False)}
        if static:
            described += f" and static fields {static}"
    return described


def _select_if(flag: bool, x: Any) -> bool:
    return flag and eqx.is_array(x)


def _select_by_path(path_filter: "Filter", prefix: KeyPath, path: KeyPath, x: Any) -> bool:
    return eqx.is_array(x) and bool(path_filter(x, path_to_str(prefix + path)))


def _select_by_leaf(argument: str, leaf_filter: Callable[[Any], Any], prefix: KeyPath,
                    path: KeyPath, x: Any) -> bool:
    if not eqx.is_array(x):
        return False
    return _flag(leaf_filter, leaf_filter(x), argument, path_to_str(prefix + path))


def _expand_spec(argument: str, prefix: KeyPath, spec: Any, subtree: Any) -> Any:
    # At module level, not nested in `leaf_mask`: under jaxtyping's import hook a
    # nested function is decorated (beartype compiles a wrapper) on every call.
    if isinstance(spec, bool):
        return jtu.tree_map(functools.partial(_select_if, spec), subtree)
    if isinstance(spec, Filter):
        return jtu.tree_map_with_path(functools.partial(_select_by_path, spec, prefix), subtree)
    if callable(spec) and not isinstance(spec, eqx.Module):
        _check_leaf_callable(argument, spec, shown(path_to_str(prefix)))
        return jtu.tree_map_with_path(
            functools.partial(_select_by_leaf, argument, spec, prefix), subtree)
    if _is_dtype(spec):
        raise where_dtype_error(argument, spec, shown(path_to_str(prefix)))
    raise WhereError(
        f"{argument} has {spec!r} at path {shown(path_to_str(prefix))}, which is "
        "not a filter. A `where` is a bool, a callable on a leaf (such as "
        "`eqx_offload.pattern(...)` or `eqx_offload.min_bytes(...)`), or a pytree "
        "prefix of the tree with those at its leaves."
    )


def leaf_mask(tree: Any, where: Any, argument: str = "where") -> list[bool]:
    """For each leaf of `jax.tree.leaves(tree)`: is it an array selected by `where`?"""
    if isinstance(where, Selection):
        count: int = jtu.tree_structure(tree).num_leaves  # type: ignore[attr-defined]  # PyTreeDef is untyped
        if len(where.flags) != count:
            raise WhereError(
                f"{argument}: a selection of {len(where.flags)} leaves was resolved for "
                f"another tree; this one has {count} leaves."
            )
        return list(where.flags)
    if isinstance(where, (bool, Filter)) and not isinstance(where, eqx.Module):  # (a spec leaf)
        return jtu.tree_leaves(_expand_spec(argument, (), where, tree))
    expand = functools.partial(_expand_spec, argument)
    try:
        mask_tree = jtu.tree_map_with_path(expand, where, tree, is_leaf=_is_spec_leaf)
    except (ValueError, TypeError) as e:
        if isinstance(e, WhereError):
            raise
        found = structure_divergence(where, tree, _is_spec_leaf)
        if found is None:
            raise
        path, what = found
        raise WhereError(
            f"{argument} is not a prefix of the tree: at path {path} it has {what}. "
            "Build the spec from the tree itself (e.g. `jax.tree.map(lambda _: True, "
            "tree)`), or use a callable such as `eqx_offload.pattern(...)`."
        ) from e
    return jtu.tree_leaves(mask_tree)


def warn_if_selects_nothing(tree: Any, where: Any, mask: list[bool], argument: str,
                            stacklevel: int = 3) -> None:
    """An `OffloadWarning` where a `where` with a `pattern` selects no array leaf of a
    tree that has arrays of one or more dimensions: valid, but almost never meant (most
    often `pattern("mu")`, a name, where `pattern` matches whole paths). Not for the
    other filters: a size or dtype filter that selects nothing in a small tree is
    meant, as is a prefix of bools; nor for a tree of scalars only."""
    if any(mask) or isinstance(where, Selection):
        return
    if not any(isinstance(x, pattern) for x in jtu.tree_leaves(where, is_leaf=_is_spec_leaf)):
        return
    paths = [path_to_str(path) for path, x in jtu.tree_flatten_with_path(tree)[0]
             if eqx.is_array(x) and x.ndim >= 1]
    if paths:
        warnings.warn(selects_nothing_message(argument, where, paths), OffloadWarning,
                      stacklevel=stacklevel)

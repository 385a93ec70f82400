"""The layout of `offloaded`'s state: which leaves live in host memory and how the
options' codec keeps each (`codec`), computed once per (tree structure, shapes, dtypes)
and used by both transfers (`fetch` to the device, `store` to host), on flat leaves.

An update looks its layout up by the structure and shapes of its arguments; only a
layout it has not seen is checked against what `inner.init` makes (`checks`)."""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast, Optional

import jax
import jax.tree_util as jtu
from jax.core import Tracer

from .._core.compat import optimization_barrier
from .._core.move import put_selected
from .._core.where import leaf_mask
from .checks import check_new_state, leaf_path
from .codec import AbstractCodec, specs_of
from .options import Options


class Cache:
    """What one `offloaded(...)` keeps between calls: its layouts by the arguments'
    structure and shapes, where the arrays of each sharding go (checked once per
    sharding), and whether it has warned. (An object, not a dict in a closure, so that
    `eqxi.closure_to_pytree`, used by optimistix, leaves it alone.)"""

    def __init__(self) -> None:
        self.layouts: dict[Any, Layout] = {}
        self.targets: dict[tuple[Any, Optional[str]], Any] = {}
        self.warned = False


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a static jit argument
class Layout:
    """One inner state's layout under one `offloaded(...)`'s options."""

    options: Options
    treedef: Any  # of the inner state
    mask: tuple[bool, ...]  # per leaf: kept in host memory between steps
    # per leaf: its spec, how the options' codec keeps it (`None`: as it is)
    init_dtypes: tuple[Any, ...]
    targets: dict[tuple[Any, Optional[str]], Any]  # the `Cache`'s

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        return jtu.tree_unflatten(self.treedef, leaves)

    def fetch(self, leaves: Sequence[Any]) -> list[Any]:
        """Every array leaf to the device's default memory, widened back where `store`
        narrowed it."""
        return fetch(self.options, leaves, self.init_dtypes, treedef=self.treedef,
                     targets=self.targets)

    def narrow(self, tree: Any) -> Any:
        """The new inner state with its selected leaves narrowed as `store` narrows
        them, left on the device (one layer's update inside the backward pass: the
        backward scan writes them into the stacked host arrays)."""
        leaves, treedef = jtu.tree_flatten(tree)
        if treedef != self.treedef:
            return tree
        codec = self.options.codec
        return jtu.tree_unflatten(treedef, [
            codec.narrow(x, s) if m and s is not None else x
            for x, m, s in zip(leaves, self.mask, self.init_dtypes, strict=True)])

    def store(self, tree: Any, memory_kind: Optional[str] = None) -> Any:
        """The new inner state with its selected leaves narrowed and sent to host
        (`memory_kind`, default the option's)."""
        leaves, treedef = jtu.tree_flatten(tree)
        mask: Sequence[bool] = self.mask
        specs: Optional[Sequence[Any]] = self.init_dtypes
        if treedef != self.treedef:  # a state that `update` grows (optax's `monitor`)
            mask, specs = leaf_mask(tree, self.options.where), None
        return jtu.tree_unflatten(treedef, store(
            self.options, leaves, memory_kind or self.options.memory_kind, mask,
            treedef=treedef, targets=self.targets, specs=specs))


def layout_for(
    inner: Any, options: Options, cache: Cache, state: Any, updates: Any,
    params: Any, extra_args: dict[str, Any],
    mask_of: Optional[Callable[[Any], Sequence[bool]]] = None,
) -> tuple[Layout, list[Any], bool]:
    """The layout of `state.inner_state` for these arguments (checked at its first use),
    the inner state's leaves, and whether any argument is traced. `mask_of(inner_state)`:
    which leaves live in host memory (default: those `options.where` selects)."""
    leaves, treedef = jtu.tree_flatten(state.inner_state)
    others, others_def = jtu.tree_flatten((updates, params, extra_args))
    traced = _any_traced(leaves) or _any_traced(others)
    key: Any = (treedef, _shapes(leaves), others_def, _shapes(others))
    try:
        layout = cache.layouts.get(key)
    except (TypeError, ValueError):  # static data that cannot be hashed or compared
        layout, key = None, None
    if layout is None:
        layout = _new_layout(inner, options, cache, state, updates, params, extra_args, mask_of)
        if key is not None:
            if len(cache.layouts) >= 256:
                cache.layouts.clear()
            cache.layouts[key] = layout
    return layout, leaves, traced


def _any_traced(leaves: list[Any]) -> bool:
    return any(isinstance(x, Tracer) for x in leaves)


def _new_layout(inner: Any, options: Options, cache: Cache, state: Any, updates: Any,
                params: Any, extra_args: dict[str, Any],
                mask_of: Optional[Callable[[Any], Sequence[bool]]]) -> Layout:
    """The layout of a state not seen before, checked against what `inner.init` makes."""
    leaves, treedef = jtu.tree_flatten(state.inner_state)
    codec = options.codec
    made = check_new_state(inner, state, updates, params, extra_args,
                           functools.partial(_as_computed, codec, options.stacked))
    mask = tuple(leaf_mask(state.inner_state, options.where) if mask_of is None
                 else mask_of(state.inner_state))
    if len(made) == len(leaves):
        specs = specs_of(codec, treedef, made, options.stacked)
    else:  # a state `update` grows (optax's `monitor`): each leaf's spec is of the leaf
        # as it is now, where that is its stored form too (its shape kept): narrowed as
        # stored, not widened back
        specs = [s if s is None or codec.stored(s).shape == tuple(x.shape) else None
                 for x, s in zip(leaves, specs_of(codec, treedef, leaves, options.stacked),
                                 strict=True)]
    return Layout(options, treedef, mask, tuple(specs), cache.targets)


def _shapes(leaves: list[Any]) -> tuple[Any, ...]:
    return tuple((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves)


def _as_computed(codec: AbstractCodec, layers: Optional[int], state: Any,
                 abstract: Any) -> Any:
    """The state as the update computes on it, for `check_new_state`: each leaf in the
    stored form of the leaf `inner.init` makes (8-bit state's packed words) as that leaf
    (abstract). A state of another structure as it is."""
    leaves, treedef = jtu.tree_flatten(state.inner_state)
    made, made_def = jtu.tree_flatten(abstract)
    if cast(Any, treedef) != made_def:  # (PyTreeDef is typed without __eq__)
        return state
    specs = specs_of(codec, made_def, made, layers)
    if all(s is None for s in specs):
        return state
    leaves = [_computed(codec, x, s) if s is not None and _is_stored(x, codec.stored(s)) else x
              for x, s in zip(leaves, specs, strict=True)]
    return state._replace(inner_state=jtu.tree_unflatten(treedef, leaves))


def _is_stored(leaf: Any, stored: jax.ShapeDtypeStruct) -> bool:
    return bool(getattr(leaf, "dtype", None) == stored.dtype
                and tuple(getattr(leaf, "shape", ())) == stored.shape)


def _computed(codec: AbstractCodec, leaf: Any, spec: Any) -> jax.ShapeDtypeStruct:
    computed = codec.computes_in(leaf.dtype, spec)
    if isinstance(computed, jax.ShapeDtypeStruct):
        return computed
    return jax.ShapeDtypeStruct(leaf.shape, computed)


# ----------------------------------------------------------------------------------------
# The two transfers, on flat leaves: `fetch` and `store`. Every update strategy
# (`strategies`, `stream`, `host_compute`, `accumulate`) moves state only through these,
# so the codec (narrow on the way to host, widen on the way back) holds in every mode.
# Both move with `_core.move.put`.


def fetch(options: Options, leaves: Sequence[Any], init_dtypes: Optional[Sequence[Any]],
          mask: Optional[Sequence[bool]] = None, argument: str = "to_device",
          treedef: Any = None, targets: Optional[dict[Any, Any]] = None) -> list[Any]:
    """The leaves `mask` selects (default all) to the device, widened back as their
    specs in `init_dtypes` (`None`: none) say where `store` narrowed them."""
    moved = _put(leaves, mask, None, argument, treedef, targets)
    if init_dtypes is None:
        return moved
    codec = options.codec
    return [x if s is None else codec.widen(x, s) for x, s in zip(moved, init_dtypes, strict=True)]


def store(options: Options, leaves: Sequence[Any], memory_kind: Optional[str],
          mask: Optional[Sequence[bool]] = None, argument: str = "memory_kind",
          treedef: Any = None, targets: Optional[dict[Any, Any]] = None,
          specs: Optional[Sequence[Any]] = None) -> list[Any]:
    """The leaves `mask` selects (default all) narrowed by the options' codec, then to
    `memory_kind` (`None`: the device), in one `put`; errors name `argument` and the
    path in `treedef`; `targets` caches destinations per (sharding, memory kind).
    The leaves narrowed are those with a spec in `specs` (the layout's `init_dtypes`,
    or else the codec's specs of the leaves at the paths of `treedef`); with neither,
    the leaves are taken as `narrowed` already."""
    codec = options.codec
    if specs is None and treedef is not None:
        specs = specs_of(codec, treedef, leaves, options.stacked)
    if specs is not None:
        leaves = [codec.narrow(x, s) if s is not None and (mask is None or m) else x
                  for x, m, s in zip(leaves, mask or [True] * len(leaves), specs, strict=True)]
    return _put(leaves, mask, memory_kind, argument, treedef, targets)


def store_tree(options: Options, tree: Any, memory_kind: str) -> Any:
    """`store` of a whole inner state, the leaves `options.where` selects. (Kept for
    `offloaded`'s `init`; a tree, not flat leaves.)"""
    leaves, treedef = jtu.tree_flatten(tree)
    specs = specs_of(options.codec, treedef, leaves, options.stacked)
    if options.codec.fences_init:
        # `init`'s state is constants (zeros): fenced, XLA narrows them when the program
        # runs instead of folding the codec over every value as it compiles.
        leaves = [optimization_barrier(x) if s is not None and isinstance(x, jax.Array) else x
                  for x, s in zip(leaves, specs, strict=True)]
    return jtu.tree_unflatten(treedef, store(options, leaves, memory_kind,
                                             leaf_mask(tree, options.where), treedef=treedef,
                                             specs=specs))


def narrowed(options: Options, leaves: Sequence[Any], specs: Sequence[Any]) -> list[Any]:
    """State leaves narrowed by the options' codec, on the device: what `store` sends to
    host (narrowing twice changes nothing). `specs`: each leaf's entry of the layout's
    `init_dtypes` (`None`: kept as it is)."""
    codec = options.codec
    return [x if s is None else codec.narrow(x, s) for x, s in zip(leaves, specs, strict=True)]


def _put(leaves: Sequence[Any], mask: Optional[Sequence[bool]], memory_kind: Optional[str],
         argument: str, treedef: Any, targets: Optional[dict[Any, Any]]) -> list[Any]:
    """`put` of the arrays `mask` selects (default all) to `memory_kind`."""
    return put_selected(leaves, mask or [True] * len(leaves), memory_kind, argument,
                        functools.partial(leaf_path, treedef), targets)


def widened_dtype(options: Options, dtype: Any, spec: Any) -> Any:
    """The dtype `fetch` gives a whole leaf of `dtype` whose spec is `spec`; a
    `jax.ShapeDtypeStruct` where its shape changes too (8-bit state's)."""
    return dtype if spec is None else options.codec.computes_in(dtype, spec)

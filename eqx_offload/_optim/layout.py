"""The layout of `offloaded`'s state: which leaves live in host memory and the dtype
`inner.init` gives each, computed once per (tree structure, shapes, dtypes) and used by
both transfers (`fetch` to the device, `store` to host), on flat leaves.

An update looks its layout up by the structure and shapes of its arguments; only a
layout it has not seen is checked against what `inner.init` makes (`checks`)."""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer

from .._core.compat import optimization_barrier
from .._core.errors import OffloadError
from .._core.move import put
from .._core.placement import destination
from .._core.where import leaf_mask
from .checks import check_new_state, leaf_path
from .options import Options
from .quantize import CODE_DTYPE, dequantize, quantize, Quantized, specs_for


KEPT_FIELDS = frozenset({"master"})
"""State fields whose leaves `host_dtype` never narrows: master weights (the `master`
of `master_weights`' `MasterState`), which keep the dtype they were made in (its
`master_dtype`, float32 by default). A narrowed master is `master_dtype`'s choice."""


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
    # per leaf: `inner.init`'s dtype (`host_dtype` only; 8-bit: a `Quantized` where the
    # leaf is kept quantised)
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
        if treedef != self.treedef or self.options.host_dtype is None:
            return tree
        return jtu.tree_unflatten(treedef, [
            _narrow(self.options, x, s) if m else x
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
    made = check_new_state(inner, state, updates, params, extra_args,
                           functools.partial(_as_computed, options.stacked)
                           if options.quantized else None)
    mask = tuple(leaf_mask(state.inner_state, options.where) if mask_of is None
                 else mask_of(state.inner_state))
    init_dtypes: list[Any] = [getattr(x, "dtype", None) for x in made]
    if options.host_dtype is None or (options.quantized and len(made) != len(leaves)):
        init_dtypes = [None] * len(leaves)
    elif len(made) != len(leaves):  # a state `update` grows (optax's `monitor`): the
        # leaves narrowed as stored, none widened back (each leaf's spec is its dtype now)
        init_dtypes = specs_of(options, treedef, leaves)
    elif options.quantized:
        init_dtypes = [spec or d for spec, d in zip(specs_for(treedef, made, options.stacked),
                                                    init_dtypes, strict=True)]
    else:
        init_dtypes = specs_of(options, treedef, list(made))
    return Layout(options, treedef, mask, tuple(init_dtypes), cache.targets)


def specs_of(options: Options, treedef: Any, leaves: list[Any]) -> list[Any]:
    """How `host_dtype` keeps each of `leaves` (flat, of a tree of structure `treedef`):
    8-bit, a `Quantized` for each moment it keeps quantised (`specs_for`); a floating
    `host_dtype`, each leaf's dtype (what `fetch` widens it back to), or `None` for a
    leaf it keeps as it is: a leaf under a `KEPT_FIELDS` field (master weights)."""
    if options.quantized:
        return specs_for(treedef, leaves, options.stacked)
    placeholders = jtu.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    paths = [p for p, _ in jtu.tree_flatten_with_path(placeholders)[0]]
    return [None if _kept(p) else getattr(x, "dtype", None)
            for p, x in zip(paths, leaves, strict=True)]


def _kept(path: tuple[Any, ...]) -> bool:
    return any(getattr(key, "name", None) in KEPT_FIELDS for key in path)


def _shapes(leaves: list[Any]) -> tuple[Any, ...]:
    return tuple((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves)


def _as_computed(layers: Optional[int], state: Any, abstract: Any) -> Any:
    """An 8-bit state as the update computes on it, for `check_new_state`: each packed
    leaf where `inner.init` makes a leaf that is kept quantised, as that leaf (abstract).
    Any other state as it is."""
    leaves, treedef = jtu.tree_flatten(state.inner_state)
    made, made_def = jtu.tree_flatten(abstract)
    if cast(Any, treedef) != made_def:  # (PyTreeDef is typed without __eq__)
        return state
    specs = specs_for(made_def, made, layers)
    leaves = [spec.spec if spec is not None and _is_packed(x, spec) else x
              for x, spec in zip(leaves, specs, strict=True)]
    return state._replace(inner_state=jtu.tree_unflatten(treedef, leaves))


def _is_packed(leaf: Any, spec: Quantized) -> bool:
    return (getattr(leaf, "dtype", None) == CODE_DTYPE
            and tuple(getattr(leaf, "shape", ())) == spec.packed)


# ----------------------------------------------------------------------------------------
# The two transfers, on flat leaves: `fetch` and `store`. Every update strategy
# (`strategies`, `stream`, `host_compute`, `accumulate`) moves state only through these,
# so `host_dtype` (narrow on the way to host, widen on the way back) holds in every mode.
# Both move with `_core.move.put`.


def fetch(options: Options, leaves: Sequence[Any], init_dtypes: Optional[Sequence[Any]],
          mask: Optional[Sequence[bool]] = None, argument: str = "to_device",
          treedef: Any = None, targets: Optional[dict[Any, Any]] = None) -> list[Any]:
    """The leaves `mask` selects (default all) to the device, widened back to
    `init_dtypes` (`None`: none) where `store` narrowed them."""
    moved = _put(leaves, mask, None, argument, treedef, targets)
    if options.host_dtype is None or init_dtypes is None:
        return moved
    return [_widen(options, x, d) for x, d in zip(moved, init_dtypes, strict=True)]


def store(options: Options, leaves: Sequence[Any], memory_kind: Optional[str],
          mask: Optional[Sequence[bool]] = None, argument: str = "memory_kind",
          treedef: Any = None, targets: Optional[dict[Any, Any]] = None,
          specs: Optional[Sequence[Any]] = None) -> list[Any]:
    """The leaves `mask` selects (default all) narrowed to `host_dtype`, then to
    `memory_kind` (`None`: the device), in one `put`; errors name `argument` and the
    path in `treedef`; `targets` caches destinations per (sharding, memory kind).
    The leaves narrowed are those `specs` (the layout's `init_dtypes`, or else
    `specs_of` the paths in `treedef`) narrows; with neither, the leaves are taken as
    `narrowed` already."""
    if options.host_dtype is not None:
        if specs is None and treedef is not None:
            specs = specs_of(options, treedef, list(leaves))
        if specs is not None:
            leaves = [_narrow(options, x, s) if mask is None or m else x
                      for x, m, s in zip(leaves, mask or [True] * len(leaves), specs,
                                         strict=True)]
    return _put(leaves, mask, memory_kind, argument, treedef, targets)


def store_tree(options: Options, tree: Any, memory_kind: str) -> Any:
    """`store` of a whole inner state, the leaves `options.where` selects. (Kept for
    `offloaded`'s `init`; a tree, not flat leaves.)"""
    leaves, treedef = jtu.tree_flatten(tree)
    specs = None if options.host_dtype is None else specs_of(options, treedef, leaves)
    if options.quantized:
        # `init`'s moments are constants (zeros): fenced, XLA quantises them when the
        # program runs instead of folding the quantiser over every value as it compiles.
        assert specs is not None
        leaves = [optimization_barrier(x) if s is not None and isinstance(x, jax.Array) else x
                  for x, s in zip(leaves, specs, strict=True)]
    return jtu.tree_unflatten(treedef, store(options, leaves, memory_kind,
                                             leaf_mask(tree, options.where), treedef=treedef,
                                             specs=specs))


def narrowed(options: Options, leaves: Sequence[Any],
             specs: Optional[Sequence[Any]] = None) -> list[Any]:
    """State leaves narrowed to `options.host_dtype` where that is narrower, on the
    device: what `store` sends to host (narrowing twice changes nothing). `specs` (each
    leaf's entry of the layout's `init_dtypes`) says which are narrowed (`specs_of`)."""
    if options.host_dtype is not None and specs is None:
        raise AssertionError("state is narrowed with each leaf's spec")
    return [_narrow(options, x, s) for x, s in zip(leaves, specs or [None] * len(leaves),
                                                   strict=True)]


def _put(leaves: Sequence[Any], mask: Optional[Sequence[bool]], memory_kind: Optional[str],
         argument: str, treedef: Any, targets: Optional[dict[Any, Any]]) -> list[Any]:
    """`put` of the arrays `mask` selects (default all) to `memory_kind`."""
    if mask is None:
        mask = [True] * len(leaves)
    destinations = [_target(x, memory_kind, argument, treedef, i, targets)
                    if selected and eqx.is_array(x) else None
                    for i, (x, selected) in enumerate(zip(leaves, mask, strict=True))]
    return put(leaves, destinations, memory_kind, argument,
               lambda i: leaf_path(treedef, i))


def _target(leaf: Any, memory_kind: Optional[str], argument: str, treedef: Any, i: int,
            targets: Optional[dict[Any, Any]]) -> Any:
    if targets is None or not isinstance(leaf, jax.Array) or isinstance(leaf, Tracer):
        return _destination(leaf, memory_kind, argument, treedef, i)
    key = (leaf.sharding, memory_kind)
    if key not in targets:
        if len(targets) >= 256:
            targets.clear()
        targets[key] = _destination(leaf, memory_kind, argument, treedef, i)
    return targets[key]


def _destination(leaf: Any, memory_kind: Optional[str], argument: str, treedef: Any,
                 i: int) -> Any:
    try:
        return destination(leaf, memory_kind, argument, "")
    except OffloadError:  # again, naming the leaf (its path costs a walk of the tree)
        return destination(leaf, memory_kind, argument, leaf_path(treedef, i))


def widened_dtype(options: Options, dtype: Any, init_dtype: Any) -> Any:
    """The dtype `fetch` gives a leaf of `dtype` whose `inner.init` dtype is
    `init_dtype`; for a quantised leaf, its `jax.ShapeDtypeStruct` (its shape changes
    too)."""
    if isinstance(init_dtype, Quantized):
        return init_dtype.spec if dtype == CODE_DTYPE else dtype
    host_dtype = options.host_dtype
    if options.quantized:
        return dtype
    if (
        host_dtype is None
        or init_dtype is None
        or dtype != host_dtype
        or not jnp.issubdtype(init_dtype, jnp.floating)
        or np.dtype(init_dtype).itemsize <= host_dtype.itemsize
    ):
        return dtype
    return init_dtype


def _widen(options: Options, leaf: Any, init_dtype: Any) -> Any:
    if isinstance(init_dtype, Quantized):
        return dequantize(leaf, init_dtype) if leaf.dtype == CODE_DTYPE else leaf
    dtype = widened_dtype(options, getattr(leaf, "dtype", None), init_dtype)
    return leaf if dtype == getattr(leaf, "dtype", None) else leaf.astype(dtype)


def _narrow(options: Options, leaf: Any, spec: Any) -> Any:
    """`leaf` in `host_dtype` if `spec` (`specs_of`) narrows it and it is a real
    floating array wider than that; 8-bit state: `leaf` quantised if `spec` is a
    `Quantized` (a floating array)."""
    host_dtype = options.host_dtype
    if options.quantized:
        if (isinstance(spec, Quantized) and isinstance(leaf, jax.Array)
                and jnp.issubdtype(leaf.dtype, jnp.floating)):
            return quantize(leaf, spec.signed, spec.rows)
        return leaf
    if (
        host_dtype is None
        or spec is None
        or not isinstance(leaf, jax.Array)
        or not jnp.issubdtype(leaf.dtype, jnp.floating)
        or leaf.dtype.itemsize <= host_dtype.itemsize
    ):
        return leaf
    return leaf.astype(host_dtype)

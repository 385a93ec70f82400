"""The optimizer's side of the update inside the backward pass: its state split in two
(the stacked layers', updated one layer at a time inside the backward pass, and the
rest's, updated after it), which of the layers' state leaves are stacked per layer,
and the proof, from the jaxpr of the update, that updating layer by layer is the
normal step.

Both halves are `transformation.init` of the parameters with the other half's leaves
`None` (as `optax.masked` runs a transformation on part of a tree), so the split holds
for any transformation, `offloaded` (host memory, `host_dtype`) and `master_weights`
included, as a black box. It is the normal step only if the update treats each
parameter apart and the layers of a stacked one apart: `check_separable` reads that off
the jaxpr of the update of the whole tree (`_stream.separable`).
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import optax

from .._core.errors import CompositionError, docs_link
from .._stream import separable
from .quantize import CODE_DTYPE
from .._stream import BLOCK, Mark, REST, SHARED


class BackwardState(NamedTuple):
    """The state of `update_in_backward`.

    **Fields:**

    - `layers`: the optimizer's state of the stacked layers (updated inside the
        backward pass, one layer at a time).
    - `rest`: the optimizer's state of every other parameter (updated after the
        backward pass).
    """

    layers: Any
    rest: Any


DOCS = docs_link("models.md", "the-update-inside-the-backward-pass")


def halves(params: Any, in_layers: Sequence[bool]) -> tuple[Any, Any]:
    """`params` (no `None` leaves) as `(layers, rest)`: the same tree, each with the
    other half's leaves `None`."""
    leaves, treedef = jtu.tree_flatten(params)
    layers = [p if m else None for p, m in zip(leaves, in_layers, strict=True)]
    rest = [None if m else p for p, m in zip(leaves, in_layers, strict=True)]
    return jtu.tree_unflatten(treedef, layers), jtu.tree_unflatten(treedef, rest)


def _abstract(tree: Any, change: Any) -> Any:
    """`tree`'s leaves as `ShapeDtypeStruct`s, each shape passed through `change`; with
    their shardings (memory kinds) where the shape is unchanged."""
    def one(a: Any) -> Any:
        shape = change(a.shape)
        sharding = getattr(a, "sharding", None) if shape == a.shape else None
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=sharding)
    return jtu.tree_map(one, tree)


def _resized(shape: tuple[int, ...], length: int) -> tuple[int, ...]:
    return (length,) + shape[1:] if shape else shape


def _changed(transformation: optax.GradientTransformationExtraArgs, params: Any,
             which: Sequence[bool],
             length: Callable[[int], int], strict: bool = True) -> list[bool]:
    """Per leaf of `transformation.init(params)`: whether its shape changes, in its
    leading axis alone, when the leading axis `n` of the parameters `which` selects
    becomes `length(n)`. A state whose structure or other axes change: refused
    (`strict`), or every leaf unchanged."""
    leaves, treedef = jtu.tree_flatten(params)
    base = jax.eval_shape(transformation.init, _abstract(params, tuple))
    other = jax.eval_shape(transformation.init, jtu.tree_unflatten(treedef, [
        jax.ShapeDtypeStruct(_resized(a.shape, length(a.shape[0])) if w else a.shape,
                             a.dtype)
        for a, w in zip(leaves, which, strict=True)]))
    base_leaves, base_def = jtu.tree_flatten(base)
    other_leaves = jtu.tree_leaves(other)
    other_def: Any = jtu.tree_structure(other)  # (`PyTreeDef` is untyped for mypy)
    changed = []
    why = "its state's structure depends on the number of layers"
    if base_def == other_def:
        for a, b in zip(base_leaves, other_leaves, strict=True):
            if a.shape == b.shape:
                changed.append(False)
            elif a.shape and b.shape == _resized(a.shape, b.shape[0]):
                changed.append(True)
            else:
                why = (f"a state leaf of shape {a.shape} changes otherwise than in its "
                       "leading axis with the number of layers " + (
                           _NESTED if CODE_DTYPE in (a.dtype, b.dtype) else
                           "(e.g. Adafactor factors a (layers, width) leaf across its "
                           "layers)"))
                break
        else:
            return changed
    if strict:
        raise _refusal(why)
    return [False] * len(base_leaves)


_NESTED = ("(8-bit state of an `offloaded` nested in the optimizer packs the layers "
           "together: pass it as `update_in_backward(..., offload=...)`)")


def _one_layer(n: int) -> int:
    """The length the state of one layer is compared at: 1 (a layer's slice), or 2 for
    a stack of 1."""
    return 1 if n > 1 else 2


def per_layer(transformation: optax.GradientTransformationExtraArgs, layers: Any) -> list[bool]:
    """Per leaf of `transformation.init(layers)` (the stacked half): whether it is
    stacked per layer (sliced with its layers) rather than shared (a step count).
    A stacked leaf that is not floating cannot come back as a gradient, and one whose
    leading axis is not the layers' holds them together: refused."""
    leaves = jtu.tree_leaves(layers)
    stacked = _changed(transformation, layers, [True] * len(leaves), _one_layer)
    state = jax.eval_shape(transformation.init, _abstract(layers, tuple))
    length = jtu.tree_leaves(layers)[0].shape[0]
    for s, m in zip(jtu.tree_leaves(state), stacked, strict=True):
        if m and s.shape[0] != length:
            raise _refusal(f"a state leaf of shape {s.shape} changes with the number of "
                           f"layers ({length}) but holds no row per layer {_NESTED}")
        if m and s.dtype != CODE_DTYPE and not jax.numpy.issubdtype(s.dtype, jax.numpy.floating):
            raise _refusal(f"a state leaf stacked per layer is of dtype {s.dtype} (the "
                           "update inside the backward pass returns the new state as a "
                           "gradient, which must be floating)")
    return stacked


def check_separable(transformation: optax.GradientTransformationExtraArgs, params: Any,
                    in_layers: Sequence[bool]) -> None:
    """Raises a `CompositionError` naming the fix unless, in `transformation.update`
    of the whole tree, each update and state leaf of the stacked layers depends only on
    the layers' leaves, layer `i` on layer `i` alone, and every other leaf on no
    stacked layer (`_stream.separable`). The update is traced on the state `init`
    makes, inside the same function: each state leaf depends on what the update
    computes it from (the gradient, the parameters), and keeps its memory kind."""
    stacked = _changed(transformation, params, in_layers, _one_layer)
    rest_dims = [not m and len(a.shape) > 0 for a, m in
                 zip(jtu.tree_leaves(params), in_layers, strict=True)]
    rest = (_changed(transformation, params, rest_dims, lambda n: n + 1, strict=False)
            if any(rest_dims) else None)
    abstract = _abstract(params, tuple)
    try:  # (the state made inside, so that it has its memory kinds)
        jaxpr, shapes = jax.make_jaxpr(
            functools.partial(_init_update, transformation), return_shape=True)(
                abstract, abstract)
    except Exception as e:  # what the update cannot do on abstract values: as is
        raise _refusal(f"its update could not be traced on the whole tree ({e})") from e
    marks_p = [Mark(frozenset({BLOCK}), 0) if m else Mark(frozenset({REST}))
               for m in in_layers]
    marks_s = [Mark(frozenset({BLOCK}), 0) if m else
               Mark(frozenset({REST})) if rest is not None and r else SHARED
               for m, r in zip(stacked, rest or stacked, strict=True)]
    out_updates, out_state = shapes
    if len(jtu.tree_leaves(out_state)) != len(marks_s):
        raise _refusal("its update changes its state's structure")
    if len(jtu.tree_leaves(out_updates)) != len(marks_p):
        raise _refusal("its updates are not one per parameter")
    expected = [Mark(m.groups) for m in marks_p] + [Mark(m.groups) for m in marks_s]
    try:
        separable.check(jaxpr, marks_p + marks_p, expected)
    except separable.Mixes as e:
        raise _refusal(str(e)) from None


def _init_update(transformation: optax.GradientTransformationExtraArgs, grads: Any,
                 params: Any) -> Any:
    return transformation.update(grads, transformation.init(params), params)


def check_not_accumulating(state: Any) -> None:
    """Refuses a state with an `optax.MultiSteps` in it, naming the route."""
    def multi(x: Any) -> bool:
        return isinstance(x, optax.MultiStepsState)
    if any(multi(x) for x in jtu.tree_leaves(state, is_leaf=multi)):
        raise CompositionError(
            "Accumulate with `scan_layers(accumulate=...)` over the micro-batches and pass "
            "the sum to `update_in_backward(...).step(..., accumulated=sum)` on the last "
            "one, in place of `optax.MultiSteps`.\nupdate_in_backward: an optax.MultiSteps "
            "would update the layers on every micro-batch inside the backward pass.\n"
            f"See {DOCS}.")


def _refusal(why: str) -> CompositionError:
    return CompositionError(
        "Use the normal step (grad, then update), or drop the transformation that needs "
        "every gradient first (clip_by_global_norm, clip_by_block_rms, Adafactor's "
        "clipping and parameter scale, apply_if_finite).\n"
        f"update_in_backward: updating layer by layer would not be the normal step: {why}.\n"
        f"See {DOCS}.")

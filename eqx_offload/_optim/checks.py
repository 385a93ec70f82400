"""The checks of `offloaded(...).update`, run only where something may be wrong: a state
layout not seen before (`check_new_state`), a trace (`check_trace`, once per trace), and
a selected leaf found in device memory (`warn_on_device`); and `init`'s check of its
parameters (`check_not_deleted`)."""

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast, Optional

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer

from .._core.compat import enclosing_donating_jit, named_axes
from .._core.errors import (deleted_array_error, device_state_error, foreign_donation_error,
                            none_leaf_error, OffloadWarning, StateError)
from .._core.leaves import is_none, path_to_str
from .._core.placement import any_on_host, memory_kind_of
from .._core.where import structure_divergence
from .state import OffloadedState


def check_not_deleted(params: Any, function: str, argument: str = "params") -> None:
    """A `DonationError` naming `params`' first deleted array (one an earlier donating call
    consumed), its path and the fix, before `function` (`"offloaded(...).init"`) would
    hand it to JAX, whose error would name only its own internals."""
    for path, x in jtu.tree_flatten_with_path(params)[0]:
        if isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.is_deleted():
            leaf = jtu.keystr(path) or "(the argument itself)"
            raise deleted_array_error(function, argument, leaf, f"{x.dtype}{list(x.shape)}")


def check_state_not_deleted(leaves: list[Any], state: Any) -> None:
    """`check_not_deleted` for an eager `update`'s state, whose flat `leaves` are at hand:
    a state a donating step consumed (the one passed to it, not the one it returned)."""
    for x in leaves:
        if isinstance(x, jax.Array) and x.is_deleted():
            check_not_deleted(state, "offloaded(...).update", "state")


def check_new_state(inner: Any, state: Any, updates: Any, params: Any,
                    extra_args: dict[str, Any],
                    view: Optional[Callable[[Any, Any], Any]] = None) -> list[Any]:
    """Refuse a state only on a real mismatch; a state this optimizer made, by `init`
    or by `update`, is never refused. Returns the leaves `inner.init` makes (abstract).
    `view(state, abstract)`: the state as checked (8-bit state: its leaves as the
    update sees them).

    Where the state has the structure and shapes of what `inner.init` makes for these
    params (or, without them, these updates), it is accepted. At the first difference
    the question is what `inner.update` itself does with the state: a state it cannot
    update is refused, naming the difference and the update's own error; one whose
    leaves it would reshape (a state for other parameters that broadcasts) is refused
    naming the leaf. Otherwise the unwrapped optimizer accepts it, and so does this
    one: the full model as `params`, a state that `update` grows (optax's `monitor`),
    an aggregator's per-example updates."""
    # Arrays only: `init` is given the arrays of a model (`eqx.filter(model,
    # eqx.is_array)`, the README's recipe) while `update` may get the whole model.
    like = eqx.filter(updates if params is None else params, eqx.is_array)
    # `filter_eval_shape`: a state may hold non-arrays (strings, Python scalars).
    abstract = eqx.filter_eval_shape(inner.init, like)
    if view is not None:
        state = view(state, abstract)
    try:
        check_state(state, abstract)
    except StateError as difference:
        _accept_or_raise(inner, state, difference, (updates, state.inner_state, params, extra_args),
                         (like, abstract))
    return jtu.tree_leaves(abstract)


def _accept_or_raise(inner: Any, state: Any, difference: StateError,
                     arguments: tuple[Any, ...], made_from: tuple[Any, Any]) -> None:
    try:
        new_state = eval_shape(functools.partial(_updated_state, inner), arguments)
    except Exception as error:  # any failure of the user's optimizer on this state
        none_leaf = _state_for_a_none_leaf(state, *made_from)
        if none_leaf is not None:
            raise none_leaf_error(*none_leaf) from error
        raise StateError(
            f"{difference} (`inner.update` cannot run on it either: "
            f"{type(error).__name__}: {first_line(error)})"
        ) from error
    reshaped = reshaped_leaf(state.inner_state, new_state)
    if reshaped is not None:
        path, old, new = reshaped
        raise StateError(
            f"offloaded(...).update(state=...): leaf inner_state/{path} is {old}, but "
            f"`inner.update` makes it {new} from these updates: the state was made "
            "for other parameters. Pass the state made by this transformation's "
            "`init` for these parameters."
        )


def _updated_state(inner: Any, updates: Any, inner_state: Any, params: Any,
                   extra_args: dict[str, Any]) -> Any:
    return inner.update(updates, inner_state, params, **extra_args)[1]


def _state_for_a_none_leaf(state: Any, like: Any, abstract: Any) -> Optional[tuple[str, str]]:
    """Where the state has an array for a leaf that is `None` in `like` (the arrays of the
    updates or params): `init` was given the whole model, a Python float (a dropout
    rate) among its leaves, whose gradient is `None`. `(leaf of like, state path)`."""
    found = structure_divergence(abstract, state.inner_state)
    if found is None or not found[1].startswith("None where"):
        return None
    for path, x in jtu.tree_flatten_with_path(like, is_leaf=is_none)[0]:
        name = path_to_str(path)
        if x is None and (found[0] == name or found[0].endswith("/" + name)):
            return jtu.keystr(path), found[0]
    return None


def check_is_offloaded(state: Any) -> None:
    """Raise a `StateError` unless `state` is an `OffloadedState`."""
    if not isinstance(state, OffloadedState):
        raise StateError(
            f"offloaded(...).update(state=...) expects the OffloadedState made by "
            f"this transformation's `init`; got {type(state).__qualname__}. Did "
            "you pass the state of the unwrapped optimizer? Call `init` on the "
            "`offloaded(...)` transformation and pass its result."
        )


def check_state(state: Any, expected: Any) -> None:
    """Raise a `StateError` unless the inner state of `state` (an `OffloadedState`:
    `update` checked that first, `check_is_offloaded`) has the structure and shapes of
    `expected` (the abstract state `inner.init` makes).

    Shapes only: a dtype may legitimately change after `init` (optax's
    `inject_hyperparams(adam)` promotes a bfloat16 moment to float32 when the params mix
    dtypes) or differ from the updates' (mixed precision); and a state may hold Python
    scalars, whose shape is `()`."""
    found = structure_divergence(expected, state.inner_state)
    if found is not None:
        path, what = found
        raise StateError(
            f"offloaded(...).update(state=...): the state does not belong to this "
            f"optimizer: at path inner_state/{path} the expected state has {what}. "
            "Pass the state returned by this transformation's `init` (or a "
            "previous `update`), not one from another optimizer."
        )
    for (key_path, want), got in zip(
        jtu.tree_flatten_with_path(expected)[0], jtu.tree_leaves(state.inner_state), strict=True
    ):
        if hasattr(want, "shape") and np.shape(got) != want.shape:
            raise StateError(
                f"offloaded(...).update(state=...): leaf inner_state/"
                f"{path_to_str(key_path)} is {getattr(got, 'dtype', type(got).__name__)}"
                f"{list(np.shape(got))} but this optimizer expects "
                f"{want.dtype}{list(want.shape)} for these updates. Pass the state "
                "made by this transformation's `init` for these parameters."
            )


def reshaped_leaf(old: Any, new: Any) -> Optional[tuple[str, str, str]]:
    """The first array leaf whose shape differs between two states of one structure:
    `(path, old shape, new shape)`, or `None` (also when the structures differ: a state
    that `update` grows, as optax's `monitor`'s does, has no leaf to compare)."""
    old_leaves, old_def = jtu.tree_flatten_with_path(old)
    new_leaves, new_def = jtu.tree_flatten(new)
    if cast(Any, old_def) != new_def:  # (PyTreeDef is typed without __eq__)
        return None
    for (key_path, a), b in zip(old_leaves, new_leaves, strict=True):
        if hasattr(b, "shape") and np.shape(a) != tuple(b.shape):
            return (path_to_str(key_path), f"{getattr(a, 'dtype', type(a).__name__)}"
                    f"{list(np.shape(a))}", f"{b.dtype}{list(b.shape)}")
    return None


def eval_shape(fn: Callable[..., Any], arguments: tuple[Any, ...]) -> Any:
    """`fn(*arguments)` abstractly: array leaves (concrete or traced) as shapes and
    dtypes, every other leaf as it is."""
    dynamic, static = eqx.partition(arguments, eqx.is_array)
    shapes = jtu.tree_map(_shape_of, dynamic)
    return jax.eval_shape(functools.partial(_call_combined, fn, static), shapes)


def _shape_of(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=jax.typeof(x).weak_type)


def _call_combined(fn: Callable[..., Any], static: Any, dynamic: Any) -> Any:
    return fn(*eqx.combine(dynamic, static))


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else "(no message)"


def leaf_path(treedef: Any, i: int) -> str:
    """The path of leaf `i` of a tree of structure `treedef` (its index without one)."""
    if treedef is None:
        return str(i)
    placeholders = jtu.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    return path_to_str(jtu.tree_flatten_with_path(placeholders)[0][i][0])


# ----------------------------------------------------------------------------------------
# Placement: checked while tracing, and eagerly until a warning is shown.


def first_on_device(leaves: Sequence[Any], mask: Sequence[bool]) -> Optional[int]:
    """The index of the first leaf `mask` selects for host memory that is in device
    memory, or `None`."""
    for i, (leaf, selected) in enumerate(zip(leaves, mask, strict=True)):
        if selected and isinstance(leaf, jax.Array):
            if isinstance(leaf, Tracer):
                if memory_kind_of(leaf) == "device":
                    return i
            elif leaf.sharding.memory_kind in (None, "device"):
                return i
    return None


def check_trace(treedef: Any, leaves: Sequence[Any], mask: Sequence[bool]) -> None:
    """The checks of a traced update: no donating jit around a host-resident state, and
    no state leaf brought to device memory by `pmap` or `shard_map`."""
    if any(isinstance(x, Tracer) for x in leaves) and any_on_host(leaves):
        _check_no_foreign_donation()
    if named_axes():
        i = first_on_device(leaves, mask)
        if i is not None:
            raise device_state_error(leaf_path(treedef, i))


def foreign_donation() -> Optional[str]:
    """The function of an enclosing `jax.jit(..., donate_argnums=...)` (or
    `donate_argnames`) that is tracing the caller, if any: `nnx.jit` and
    `eqx.filter_jit` with donation are such jits (`compat.enclosing_donating_jit`: JAX
    has no public way to ask). `None` where none donates anything (JAX donates nothing
    under `jax_debug_nans`)."""
    if getattr(jax.config, "jax_debug_nans", False):
        return None
    return enclosing_donating_jit()


def _check_no_foreign_donation() -> None:
    """A `CompositionError` where a host-resident state is traced for a jit that donates
    without memory-kind-aware output shardings (`nnx.jit(..., donate_argnums=...)`,
    `eqx.filter_jit(donate=...)`, `jax.jit(..., donate_argnums=...)`): JAX would pair a
    donated input with an output of the same shape and dtype in the other memory, and
    XLA abort the process at the call. Raised while tracing: nothing has run, nothing
    is donated."""
    name = foreign_donation()
    if name is None:
        return
    raise foreign_donation_error(name)


def warn_on_device(treedef: Any, leaves: Sequence[Any], i: int, memory_kind: str) -> bool:
    """Warn that leaf `i`, selected for host memory, is in device memory."""
    path = leaf_path(treedef, i)
    if isinstance(leaves[i], Tracer):
        # Traced, and typed as device memory: the function around `update` was traced
        # without the state's memory kinds. Concrete host arrays carry theirs into
        # `jax.jit`; `jax.ShapeDtypeStruct`s do not (`jax.export`, `.trace`, `.lower`
        # with specs), and then the program has no copy to the device: on a GPU the
        # update would read host memory.
        warnings.warn(
            f"offloaded(...).update: state leaf inner_state/{path} arrives in device "
            f"memory in a traced function, but `where` selects it for {memory_kind!r}. "
            "The function was traced without the state's memory kinds (`jax.export` or "
            "`jax.jit(...).trace/lower` with `jax.ShapeDtypeStruct` specs, or a "
            "`jax.jit` without `in_shardings`), so the program it makes never copies "
            "the state to the device. Export or lower the step through "
            "`eqx_offload.filter_jit`: `eqx_offload.filter_jit(step).export(platforms="
            "[...])(*args)` or `.lower(*args)` with the real arrays (or give `jax.jit` "
            "`in_shardings` and `out_shardings` with memory kinds). (Shown once per "
            "transformation.)",
            OffloadWarning,
            stacklevel=4,
        )
        return True
    warnings.warn(
        f"offloaded(...).update: state leaf inner_state/{path} "
        f"is in device memory, but `where` selects it for {memory_kind!r}. "
        "It is used as is and the new state goes to host. This happens "
        "when a state was restored without host shardings (see "
        "`eqx_offload.checkpoint.host_shardings`), placed with a device sharding (e.g. "
        "`eqx.filter_shard(opt_state, sharding)` outside `jit`: use "
        "`eqx_offload.filter_shard`, which keeps memory kinds), or made "
        "with another `where`. (This warning is shown once per transformation.)",
        OffloadWarning,
        stacklevel=4,
    )
    return True

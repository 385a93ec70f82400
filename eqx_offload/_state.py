"""The state of `offloaded`: its type, reading it, and checking what `update` is given."""

import functools
import warnings
from collections.abc import Callable
from typing import Any, cast, NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._errors import StateError
from ._leaves import is_traced, path_to_str
from ._move import move
from ._placement import memory_kind_of
from ._where import structure_divergence


class OffloadedState(NamedTuple):
    """The state of `offloaded(inner)`.

    **Fields:**

    - `inner_state`: the state of `inner`, with the leaves selected by `where` in host
        memory between steps.

    Reading an attribute the inner state has (`opt_state.hyperparams`, `.count`,
    `.mini_step`, ...) returns it with its array leaves brought to the device, so the
    optax ways of reading a state work as they do on the unwrapped one:
    `opt_state.hyperparams["learning_rate"]` (`inject_hyperparams`),
    `optax.MultiSteps(...).has_updated(opt_state)`,
    `optax.contrib.schedule_free_eval_params(opt_state, params)`. (The host copy is not
    changed; under `jit` the move is part of the traced program.) An attribute none of
    whose leaves is in host memory comes back as the inner state's own object, so
    `opt_state.hyperparams["learning_rate"] = 0.1` changes the state, as optax
    documents; `hyperparams` with leaves in host memory (`where=True`) comes back as a
    device copy whose assignments write through to the state, the new value placed in
    host memory. `optax.tree.get` and
    `optax.tree_utils.tree_get` search the whole state, so they find a hyperparameter
    through `inner_state` as they are.

    !!! Example

        ```python
        import jax.numpy as jnp
        import optax
        import eqx_offload

        params = {"w": jnp.ones((3, 3))}
        opt = eqx_offload.offloaded(optax.inject_hyperparams(optax.adam)(learning_rate=0.1))
        state = opt.init(params)
        assert state.hyperparams["learning_rate"] == 0.1
        assert optax.tree.get(state, "learning_rate") == 0.1
        ```
    """

    inner_state: Any

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails, so `inner_state`, the tuple methods and
        # the NamedTuple machinery are untouched. Private names are never forwarded
        # (copy, pickle and JAX probe for `__jax_array__`, `_fields`, ...).
        if name.startswith("_"):
            raise AttributeError(name)
        inner = tuple.__getitem__(self, 0)
        try:
            value = getattr(inner, name)
        except AttributeError:
            raise AttributeError(
                f"'OffloadedState' object has no attribute {name!r}, nor has its "
                f"inner_state ({type(inner).__qualname__})"
            ) from None
        moved = move(value, True, None, "to_device")
        # Nothing moved (e.g. `inject_hyperparams`'s 0-d hyperparameters, which stay on
        # the device): the inner state's own object, so that writing into it in place,
        # as optax documents (`opt_state.hyperparams["learning_rate"] = 0.1`), changes
        # the state.
        if all(a is b for a, b in zip(jtu.tree_leaves(moved), jtu.tree_leaves(value), strict=True)):
            return value
        if name == "hyperparams" and type(moved) is dict:  # `where=True`: write through
            return _WriteThrough(moved, value)
        return moved


class _WriteThrough(dict[Any, Any]):
    """A device copy of the `hyperparams` dict of an `OffloadedState`'s inner state
    whose assignments also change the state, placed in the memory of the value they
    replace: `opt_state.hyperparams["learning_rate"] = 0.1` with `where=True`."""

    def __init__(self, copy: dict[Any, Any], original: dict[Any, Any]) -> None:
        super().__init__(copy)
        self._original = original

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        kind = memory_kind_of(self._original.get(key))
        if kind not in (None, "device"):
            value = move(jnp.asarray(value), True, kind, "to_host")
        self._original[key] = value


jtu.register_pytree_with_keys(  # flattened as a dict (and rebuilt as one)
    _WriteThrough,
    lambda d: (tuple((jtu.DictKey(k), d[k]) for k in sorted(d)), tuple(sorted(d))),
    lambda keys, values: dict(zip(keys, values, strict=True)),  # type: ignore[arg-type,return-value]  # a plain dict: a new tree, nothing to write through
)


class OffloadWarning(UserWarning):
    """A state leaf that should be in host memory was found in device memory."""


def check_state(state: Any, expected: Any) -> None:
    """Raise a `StateError` unless `state` is an `OffloadedState` whose inner state has
    the structure and shapes of `expected` (the abstract state `inner.init` makes).

    Shapes only: a dtype may legitimately change after `init` (optax's
    `inject_hyperparams(adam)` promotes a bfloat16 moment to float32 when the params mix
    dtypes) or differ from the updates' (mixed precision); and a state may hold Python
    scalars, whose shape is `()`."""
    if not isinstance(state, OffloadedState):
        raise StateError(
            f"offloaded(...).update(state=...) expects the OffloadedState made by "
            f"this transformation's `init`; got {type(state).__qualname__}. Did "
            "you pass the state of the unwrapped optimizer? Call `init` on the "
            "`offloaded(...)` transformation and pass its result."
        )
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


def first_on_device(inner_state: Any, mask: list[bool]) -> Optional[str]:
    """The path of the first leaf `mask` selects for host memory that is in device
    memory, or `None`."""
    for (path, leaf), selected in zip(
        jtu.tree_flatten_with_path(inner_state)[0], mask, strict=True
    ):
        if selected and isinstance(leaf, jax.Array) and memory_kind_of(leaf) == "device":
            return path_to_str(path)
    return None


def warn_if_on_device(inner_state: Any, mask: list[bool], memory_kind: str) -> bool:
    """Warn (and return `True`) if a leaf selected for host memory is in device memory."""
    path = first_on_device(inner_state, mask)
    if path is None:
        return False
    leaf = dict((path_to_str(p), x) for p, x in jtu.tree_flatten_with_path(inner_state)[0])[path]
    if is_traced(leaf):
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
        "`eqx_offload.host_shardings`), placed with a device sharding (e.g. "
        "`eqx.filter_shard(opt_state, sharding)` outside `jit`: use "
        "`eqx_offload.filter_shard`, which keeps memory kinds), or made "
        "with another `where`. (This warning is shown once per transformation.)",
        OffloadWarning,
        stacklevel=4,
    )
    return True


# ----------------------------------------------------------------------------------------
# Deciding at a difference (`_Offloaded._check_state`)


def abstract_signature(tree: Any) -> Any:
    """A hashable abstract signature of `tree`: its structure, and per leaf its shape,
    dtype and weak type (arrays, traced or not) or its type (anything else)."""
    leaves, treedef = jtu.tree_flatten(tree)
    return treedef, tuple(
        (np.shape(x), x.dtype, jax.typeof(x).weak_type) if eqx.is_array(x) else type(x)
        for x in leaves
    )


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

"""The state of `offloaded`: its type and reading it."""

from typing import Any, NamedTuple

import jax.numpy as jnp
import jax.tree_util as jtu

from .._core.move import move
from .._core.placement import memory_kind_of


class OffloadedState(NamedTuple):
    """The state of `offloaded(inner)`.

    **Fields:**

    - `inner_state`: the state of `inner`, with the leaves selected by `where` in host
        memory between steps.

    Reading the state as optax users read the unwrapped one reads the inner state:
    indexing (`opt_state[0]` is `inner_state[0]`, so `opt_state[0].count` is Adam's
    step counter, as with plain `optax.adam`) and attributes the inner state has
    (`opt_state.count`, `.hyperparams`, `.mini_step`, ...; the tuple methods `count`
    and `index` included). What is read comes with its array leaves brought to the
    device, so it can be computed on, under `jit` too (the move is then part of the
    traced program; the host copy is not changed). This makes
    `opt_state.hyperparams["learning_rate"]` (`inject_hyperparams`),
    `optax.MultiSteps(...).has_updated(opt_state)` and
    `optax.contrib.schedule_free_eval_params(opt_state, params)` work as they do on the
    unwrapped state. `opt_state.inner_state` is the state as it is stored, host arrays
    included (the way to check where a leaf lives). `len`, iteration and unpacking stay
    those of this one-field `NamedTuple`, so the pytree is unchanged.

    A value none of whose leaves is in host memory comes back as the inner state's own
    object, so `opt_state.hyperparams["learning_rate"] = 0.1` changes the state, as
    optax documents; `hyperparams` with leaves in host memory (`where=True`) comes back
    as a device copy whose assignments write through to the state, the new value placed
    in host memory. `optax.tree.get` and `optax.tree_utils.tree_get` search the whole
    state and return leaves as they are stored: the same as for the unwrapped state for
    what the default `where` keeps on the device (step counters, hyperparameters), host
    arrays for the rest (`to_device` them before computing on them in a step).

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
        assert state.count == 0 and state[0] == 0  # InjectHyperparamsState's count
        ```
    """

    inner_state: Any

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails, so `inner_state` and the NamedTuple
        # machinery are untouched. Private names are never forwarded (copy, pickle and
        # JAX probe for `__jax_array__`, `_fields`, ...).
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
        return _read(inner, value)

    # `tuple.count` and `tuple.index` would shadow the inner state's (Adam's step counter
    # `count`): read through, as every other attribute. (A property in place of tuple's
    # method, on purpose: the checkers that flag the override are told so.)
    @property
    def count(self) -> Any:  # pyright: ignore[reportIncompatibleMethodOverride]  # pyrefly: ignore[bad-override]
        return self.__getattr__("count")

    @property
    def index(self) -> Any:  # pyright: ignore[reportIncompatibleMethodOverride]  # pyrefly: ignore[bad-override]
        return self.__getattr__("index")

    def __getitem__(self, index: Any) -> Any:  # the inner state's items
        inner = tuple.__getitem__(self, 0)
        try:
            value = inner[index]
        except TypeError:
            raise TypeError(
                f"OffloadedState[{index!r}] reads inner_state[{index!r}], and its "
                f"inner_state ({type(inner).__qualname__}) cannot be indexed so"
            ) from None
        return _read(inner, value)


def _read(inner: Any, value: Any) -> Any:
    """`value`, read from the inner state `inner`, with its array leaves on the device."""
    moved = move(value, True, None, "to_device")
    # Nothing moved (e.g. `inject_hyperparams`'s 0-d hyperparameters, which stay on
    # the device): the inner state's own object, so that writing into it in place,
    # as optax documents (`opt_state.hyperparams["learning_rate"] = 0.1`), changes
    # the state.
    if all(a is b for a, b in zip(jtu.tree_leaves(moved), jtu.tree_leaves(value), strict=True)):
        return value
    hyperparams = getattr(inner, "hyperparams", None)
    if type(moved) is dict and value is hyperparams and isinstance(hyperparams, dict):
        return _WriteThrough(moved, hyperparams)  # `where=True`: assignments write through
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

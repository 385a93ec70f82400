"""The state of `offloaded`: its type and reading it."""

from typing import Any, NamedTuple

import jax.tree_util as jtu

from ._move import move


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
    documents. `optax.tree.get` and
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
        return moved


class OffloadWarning(UserWarning):
    """A state leaf that should be in host memory was found in device memory."""

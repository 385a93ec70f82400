"""`offloaded`: an optax transformation whose state lives in host memory between steps."""

import warnings
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.tree_util as jtu
import numpy as np
import optax

from ._errors import NotATransformationError, StateError
from ._jit import filter_jit
from ._memory import check_host_kind
from ._move import move
from ._stream import Compute, check_options, host_update, streamed_update
from ._types import HostMemoryKind, Where
from ._where import is_traced, leaf_mask, min_ndim, path_to_str, structure_divergence


class OffloadedState(NamedTuple):
    """The state of `offloaded(inner)`.

    **Fields:**

    - `inner_state`: the state of `inner`, with the leaves selected by `where` in host
        memory between steps.
    """

    inner_state: Any


class OffloadWarning(UserWarning):
    """A state leaf that should be in host memory was found in device memory."""


DEFAULT_WHERE = min_ndim(1)


def _memory_space_of(leaf: Any) -> Optional[str]:
    if is_traced(leaf):
        if jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return None  # unknown: JAX (0.10.2) types a host key array as device memory
        space = jax.typeof(leaf).memory_space
        return "host" if space == jax.memory.Space.Host else "device"
    if isinstance(leaf, jax.Array):
        return "host" if leaf.sharding.memory_kind in ("pinned_host", "unpinned_host") else "device"
    return None


def offloaded(
    inner: Union[optax.GradientTransformation, optax.MultiSteps],
    where: Where = DEFAULT_WHERE,
    *,
    memory_kind: HostMemoryKind = "pinned_host",
    group_bytes: Optional[int] = None,
    compute: Compute = "device",
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation so that its state lives in host memory.

    `init` creates the state directly in host memory (the full state never exists on
    the device). `update` moves the selected state leaves to the device, runs
    `inner.update` there, and moves the new state back; its updates and new state are
    bitwise equal to those of `inner`.

    **Arguments:**

    - `inner`: any `optax.GradientTransformation`, e.g. `optax.adamw(1e-3)` or a whole
        `optax.chain(...)`, or an `optax.MultiSteps` (its `gradient_transformation()`
        is used).
    - `where`: which leaves of the inner state to keep in host memory (see `to_host`;
        paths are those of the inner state). Default `eqx_offload.min_ndim(1)`: every
        array except 0-d scalars, so step counters stay on the device (offloading 4
        bytes costs a transfer and saves nothing).
    - `memory_kind`: `"pinned_host"` (default) or `"unpinned_host"` (eager use only).
    - `group_bytes`: stream the update (default `None`: bring the whole state to the
        device at once). The state comes to the device one group of at most this many
        bytes at a time, each group going back to host before the next comes in, so
        the state's share of peak device memory is one group. A parameter's state is
        never split; `0` streams one parameter at a time. Raises `CompositionError`
        at the first `update` for optimizers that combine the new state of several
        parameters (`apply_if_finite`, `MultiSteps`, a global norm after a stateful
        transformation). See `eqx_offload.stream_plan` and the "Modes" docs page.
    - `compute`: `"device"` (default) or `"host"`: run `inner.update` on the host CPU
        (`jax.experimental.compute_on.compute_on("device_host")`), so the state never
        comes to the device; gradients go to host and updates come back.

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose state is an `OffloadedState`.
    Extra arguments to `update` are passed to `inner`.

    **Composition:** `offloaded` goes around any transformation or chain, anywhere in
    an `optax.chain`, and inside `masked`, `multi_transform`, `inject_hyperparams`,
    `apply_if_finite` and `optax.contrib.schedule_free` (they only pass its state
    along). `optax.MultiSteps` computes on the state of what it wraps (a `jnp.where`
    between the old and the new inner state), so it belongs *inside*:
    `offloaded(optax.MultiSteps(...))`. The other order computes on host-resident
    arrays (on a GPU, XLA runs that select on the host), and `eqx_offload.filter_jit`
    rejects it with a `CompositionError`. Outermost is always safe, and it also
    offloads the wrapper's own buffers (such as the `MultiSteps` accumulator).

    !!! Example

        ```python
        import jax.numpy as jnp
        import optax
        import eqx_offload

        params = {"w": jnp.ones((3, 3))}
        opt = eqx_offload.offloaded(optax.adamw(1e-3))
        state = opt.init(params)
        assert state.inner_state[0].mu["w"].sharding.memory_kind == "pinned_host"
        updates, state = opt.update(params, state, params)
        ```
    """
    if not isinstance(inner, optax.GradientTransformation) and callable(
        getattr(inner, "gradient_transformation", None)
    ):  # `optax.MultiSteps`, which is not itself a GradientTransformation. Its
        # `gradient_transformation()` is a plain `GradientTransformation`, whose extra
        # arguments `with_extra_args_support` would drop; its `update` takes them.
        inner = optax.GradientTransformationExtraArgs(inner.init, inner.update)
    if not isinstance(inner, optax.GradientTransformation):
        hint = ""
        if callable(inner):
            hint = (" It is callable: if it is an optimizer factory such as "
                    "`optax.adamw`, call it first (`optax.adamw(1e-3)`).")
        raise NotATransformationError(
            f"offloaded(inner=...) expects an optax.GradientTransformation, e.g. "
            f"`optax.adamw(1e-3)`; got {type(inner).__module__}.{type(inner).__qualname__}."
            + hint
        )
    check_host_kind(memory_kind, "memory_kind")
    check_options(group_bytes, compute)
    inner = optax.with_extra_args_support(inner)
    shapes: dict[Any, Any] = {}
    warned = [False]

    def init_on_host(params: optax.Params) -> Any:
        return move(inner.init(params), where, memory_kind, "memory_kind")

    # Under `jit` the moment state is created it is sent to host, so XLA never holds
    # the whole state in device memory at once. `unpinned_host` is only reachable
    # eagerly, so for it the jitted part stops at `inner.init`. `filter_jit` (not
    # `eqx.filter_jit`) gives each state leaf the sharding of the parameter it mirrors
    # (same shape, matching path), so a sharded model gets a sharded state.
    jitted_init = filter_jit(init_on_host if memory_kind == "pinned_host" else inner.init)

    def init_fn(params: optax.Params) -> OffloadedState:
        if any(is_traced(x) for x in jtu.tree_leaves(params)):
            return OffloadedState(init_on_host(params))
        state = jitted_init(params)
        if memory_kind != "pinned_host":
            state = move(state, where, memory_kind, "memory_kind")
        return OffloadedState(state)

    def expected_state(updates: optax.Updates) -> Any:
        key = jtu.tree_structure(updates), tuple(
            (getattr(x, "shape", None), getattr(x, "dtype", None))
            for x in jtu.tree_leaves(updates)
        )
        if key not in shapes:
            shapes[key] = jax.eval_shape(inner.init, updates)
        return shapes[key]

    def check_state(state: Any, updates: optax.Updates) -> None:
        if not isinstance(state, OffloadedState):
            raise StateError(
                f"offloaded(...).update(state=...) expects the OffloadedState made by "
                f"this transformation's `init`; got {type(state).__qualname__}. Did "
                "you pass the state of the unwrapped optimizer? Call `init` on the "
                "`offloaded(...)` transformation and pass its result."
            )
        expected = expected_state(updates)
        found = structure_divergence(expected, state.inner_state)
        if found is not None:
            path, what = found
            raise StateError(
                f"offloaded(...).update(state=...): the state does not belong to this "
                f"optimizer: at path inner_state/{path} the expected state has {what}. "
                "Pass the state returned by this transformation's `init` (or a "
                "previous `update`), not one from another optimizer."
            )
        # Shapes only: a dtype may legitimately change after `init` (optax's
        # `inject_hyperparams(adam)` promotes a bfloat16 moment to float32 when the
        # params mix dtypes) or differ from the updates' (mixed precision).
        for (key_path, want), got in zip(
            jtu.tree_flatten_with_path(expected)[0], jtu.tree_leaves(state.inner_state)
        ):
            # `np.shape`: a state may hold Python scalars (shape `()`).
            if hasattr(want, "shape") and np.shape(got) != want.shape:
                raise StateError(
                    f"offloaded(...).update(state=...): leaf inner_state/"
                    f"{path_to_str(key_path)} is {getattr(got, 'dtype', type(got))}"
                    f"{list(getattr(got, 'shape', []))} but this optimizer expects "
                    f"{want.dtype}{list(want.shape)} for these updates. Pass the state "
                    "made by this transformation's `init` for these parameters."
                )

    def warn_if_on_device(inner_state: Any) -> None:
        if warned[0]:
            return
        keyed = jtu.tree_flatten_with_path(inner_state)[0]
        for (path, leaf), selected in zip(keyed, leaf_mask(inner_state, where)):
            if selected and _memory_space_of(leaf) == "device":
                warned[0] = True
                warnings.warn(
                    f"offloaded(...).update: state leaf inner_state/{path_to_str(path)} "
                    f"is in device memory, but `where` selects it for {memory_kind!r}. "
                    "It is used as is and the new state goes to host. This happens "
                    "when a state was restored without host shardings (see "
                    "`eqx_offload.host_shardings`) or made with another `where`. "
                    "(This warning is shown once per transformation.)",
                    OffloadWarning,
                    stacklevel=3,
                )
                return

    def update_fn(
        updates: optax.Updates,
        state: OffloadedState,
        params: Optional[optax.Params] = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, OffloadedState]:
        check_state(state, updates)
        warn_if_on_device(state.inner_state)
        if compute == "host":
            updates, inner_state = host_update(
                inner, updates, state.inner_state, params, extra_args,
                where=where, memory_kind=memory_kind,
            )
        elif group_bytes is not None:
            updates, inner_state = streamed_update(
                inner, updates, state.inner_state, params, extra_args,
                group_bytes=int(group_bytes), memory_kind=memory_kind,
            )
        else:
            inner_state = move(state.inner_state, True, None, "to_device")
            updates, inner_state = inner.update(updates, inner_state, params, **extra_args)
        return updates, OffloadedState(move(inner_state, where, memory_kind, "memory_kind"))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

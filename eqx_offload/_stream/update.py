"""The streamed update: `offloaded`'s default under `jit` (`group_bytes="auto"`), and
`offloaded(..., group_bytes=N)`.

Bringing the whole optimizer state to the device at once needs room for all of it at
the peak of the step (in the GPU plan, the default of earlier releases held as much
device memory as not offloading at all). The streamed update brings it one group of
leaves at a time, so the state's share of peak device memory is a few groups.

How the groups are found, and why the result stays bitwise equal: `inner.update` is
traced once to a jaxpr. A dependency analysis on that jaxpr finds which offloaded state
leaves are read together by some operation (Adam's `mu` and `nu` of one parameter are);
those leaves form an indivisible *unit*. Units are packed in reverse leaf order (the order
the backward pass produces gradients, see `groups.pack`; the pieces of a stack's leaves
take turns, `groups.interleave`) into groups of at most `group_bytes`
(`"auto"`: about 1/16 of the streamed state, at most 256 MiB). The jaxpr's own equations are then evaluated stage by stage: each
equation runs in the stage of the group it depends on, and equations that depend on no
offloaded state (gradient clipping by global norm, schedules, bias-correction scalars)
run in the stage of their first consumer. The streamed program is made of exactly the
equations of `inner.update`, so its results are those of `inner.update` by construction.

The order is enforced with data dependencies XLA must respect. The state of group `g`,
still on host, passes through one `jax.lax.optimization_barrier` together with the new
state of group `g - 1 - lookahead`, already sent to host: XLA cannot bring group `g` to
the device before that group is back on host. With `lookahead=1` (the default, double
buffering) group `g + 1` comes in while group `g` is updated and group `g - 1` goes
back, so both copy directions run at once. The same barrier takes the new state of
group `g - 1` as computed on the device (before it is sent to host): group `g` comes in
once the update before it has run, so the state arrives while the backward pass
computes the gradients of the next layer, a group at a time, instead of wherever XLA's
scheduler would start the copy (for the first groups, during the forward pass).
`lookahead=0` brings one group at a time. No other device value is fenced (the
gradients, the updates, scalars), so XLA sees the data flow of the unwrapped update:
the updates fuse into their consumer (`apply_updates`), and every value is computed as
the unwrapped update computes it. (The new state is elementwise and goes to host
anyway; fencing a gradient instead changes how XLA's CPU backend fuses the reduction
that makes it, and with it the last bit of a bias's Adam moments.)

Stacked layers (`eqx.filter_vmap` over a layer: one `(layers, d_in, d_out)` leaf for
all of them): a unit of leaves with at least 3 dimensions whose update is elementwise
along their leading axis (`rows.sliceable`, decided on the jaxpr) and that is larger than a
group is split into pieces of whole rows (`groups.pack`). A piece reads its rows of each
host buffer, runs the unit's equations on them (`rows.piece_eqns`), and writes its new rows
back into that buffer, in place (`dynamic_update_slice`); its rows of the update go into
the gradient's buffer (`rows.tails`). The same equations on the same rows: the results stay
bitwise.

What cannot be streamed (with `group_bytes=N`, a `CompositionError` when the update is
first traced; with `"auto"`, the whole state comes to the device at once instead): an update that
couples the state of several parameters so that no group boundary can be drawn between
them, e.g. `optax.apply_if_finite`, `optax.MultiSteps` or a global statistic computed
*after* a stateful transformation (`chain(adam, clip_by_global_norm)`); and an update
with side effects (callbacks), which streaming would reorder.

This module is the engine's one door (`_optim` imports nothing else of `_stream`): the
analysis (units, groups, pieces, the stage of every equation) is `schedule`'s, on the
jaxpr alone; `runner` runs the schedule it returns, moving state only through the
caller's `Transfers`; `host` runs the whole update on the host CPU instead.
"""

from collections.abc import Sequence
from typing import Any, Union

import equinox as eqx
import jax.tree_util as jtu

from .._core.inner import as_transformation
from .host import host_update as host_update
from .plan import StreamPlan as StreamPlan
from .runner import run
from .schedule import schedule
from .trace import trace_streamable
from .transfers import Transfers as Transfers


def streamed_update(
    inner: Any, updates: Any, inner_state: Any, params: Any, extra_args: dict[str, Any], *,
    transfers: Transfers, group_bytes: Union[int, str], init_dtypes: Sequence[Any],
) -> tuple[Any, Any]:
    """The streamed update: `inner.update` with the offloaded state brought to the device
    group by group (`group_bytes` as `offloaded`'s), moved by `transfers`. Returns the
    updates and the new inner state with its offloaded leaves back in (pinned) host
    memory. Raises `NotStreamable` for an update that cannot be streamed."""
    arrays = [(x, d) for x, d in zip(jtu.tree_leaves(inner_state), init_dtypes, strict=True)
              if eqx.is_array(x)]
    traced = trace_streamable(inner, updates, inner_state, params, extra_args,
                              [transfers.computes_in(x.dtype, d) for x, d in arrays])
    plan = schedule(traced, group_bytes)  # may raise NotStreamable
    return traced.rebuild(run(traced, plan, transfers, [d for _, d in arrays]))


def stream_plan(
    inner: Any,
    updates: Any,
    inner_state: Any,
    params: Any = None,
    *,
    group_bytes: Union[int, str] = "auto",
    **extra_args: Any,
) -> StreamPlan:
    """The groups that `offloaded(inner, group_bytes=group_bytes)` streams for these
    arguments (it traces `inner.update` abstractly; nothing is computed).

    **Arguments:**

    - `inner`: the inner `optax.GradientTransformation` (not the `offloaded` one).
    - `updates`, `params`, `**extra_args`: as for `update` (arrays or
        `jax.ShapeDtypeStruct`s are both fine for `updates` and `params`).
    - `inner_state`: the inner state as it is between steps, i.e.
        `offloaded(...).init(params).inner_state`: leaves in host memory are streamed.
    - `group_bytes`: as for `offloaded` (default `"auto"`, as `offloaded`'s default).

    **Returns:**

    A `StreamPlan`.

    **Raises:**

    `CompositionError` if the update cannot be streamed (see `offloaded`).

    !!! Example

        ```python
        import jax.numpy as jnp
        import optax
        import eqx_offload

        params = {"a": jnp.ones((256, 256)), "b": jnp.ones((256, 256))}
        opt = eqx_offload.offloaded(optax.adam(1e-3), group_bytes=1 << 19)
        state = opt.init(params)
        plan = eqx_offload.stream.stream_plan(
            optax.adam(1e-3), params, state.inner_state, group_bytes=1 << 19
        )
        assert len(plan.groups) == 2  # mu and nu of "a", then of "b"
        ```
    """
    inner = as_transformation(inner, "stream_plan(inner=...)")
    traced = trace_streamable(inner, updates, inner_state, params, extra_args)
    return schedule(traced, group_bytes).plan

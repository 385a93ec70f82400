"""The host-compute update: `offloaded(..., compute="host")`, the jaxpr of `inner.update`
evaluated with a rule of its own (`on_host`).

`inner.update` runs on the host CPU under `compute_on(..., compute_type="device_host")`
(`compat.host_compute`): the state never reaches the device; gradients (and
parameters, if the transformation reads them) go to host and the updates come back.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from .._core.compat import host_compute, JAXPR_TYPES
from .._core.errors import CompositionError, see
from .._core.move import move
from .._core.where import leaf_mask
from .jaxpr import bind, evaluate, is_var, where_made
from .trace import trace_update


def _is_program(x: Any) -> bool:
    return isinstance(x, JAXPR_TYPES) or (
        isinstance(x, (tuple, list)) and any(_is_program(y) for y in x)
    )


def _has_subprogram(eqn: Any) -> bool:
    return any(_is_program(v) for v in eqn.params.values())


def on_host(eqn: Any, invals: list[Any]) -> list[Any]:
    """The rule that evaluates an equation traced for device memory on host operands.

    JAX types memory spaces: an operation's array operands must all be in one memory,
    and arrays an update creates itself (`jnp.where(c, x, 0.0)` broadcasts `0.0`) are
    typed for device memory. Inside the host computation everything lives on the host,
    so such arrays are retyped to host memory where they meet host operands, and a
    move to the device leaves its operands where they are.
    """
    host = jax.memory.Space.Host
    if eqn.primitive.name == "device_put" and all(
            d == jax.memory.Space.Device for d in eqn.params["devices"]):
        # A move to the device (`host_weights_optimizer` fetches its parameters and gradients)
        # stays on the host here: XLA:TPU refuses a device placement in a host
        # computation.
        return list(invals)
    spaces = [jax.typeof(x).memory_space if np.ndim(x) else None for x in invals]
    if host in spaces:
        if _has_subprogram(eqn):
            raise CompositionError(
                "offloaded(..., compute='host'): the update contains "
                f"{where_made(eqn)}, a control-flow or call primitive whose body "
                "was traced for device memory; JAX cannot run it on host-memory "
                "operands. Combinators that branch on the state (`optax.MultiSteps`, "
                "`optax.apply_if_finite`) are among these. Use compute='device' (the "
                "default) for this optimizer."
            )
        invals = [
            jax.device_put(x, host) if s is not None and s != host else x
            for x, s in zip(invals, spaces, strict=True)
        ]
    return bind(eqn, invals)


def host_update(
    inner: Any, updates: Any, inner_state: Any, params: Any, extra_args: dict[str, Any], *,
    where: Any,
) -> tuple[Any, Any]:
    """The host-compute update (`compute="host"`): `inner.update` on the host CPU. Returns the updates in device memory and
    the new inner state with the leaves `where` selects in (pinned) host memory and the
    others in device memory."""
    traced = trace_update(inner, updates, inner_state, params, extra_args)
    # Only what the update reads goes to host (Adam never reads the parameters).
    read = {v for e in traced.jaxpr.eqns for v in e.invars if is_var(v)}
    read |= {v for v in traced.jaxpr.outvars if is_var(v)}
    used = [i for i, v in enumerate(traced.jaxpr.invars) if v in read]
    args = list(traced.flat_args)
    moved = move([args[i] for i in used], True, "pinned_host", "compute='host'")
    for i, x in zip(used, moved, strict=True):
        args[i] = x

    def run(*leaves: Any) -> list[Any]:
        return evaluate(traced.jaxpr, traced.consts, leaves, on_host)

    # Where each output goes: updates to the device, state leaves that `where` selects to
    # host, the others (step counters) to the device.
    selected = [m for x, m in zip(jtu.tree_leaves(inner_state),
                                  leaf_mask(inner_state, where), strict=True)
                if eqx.is_array(x)]
    device, host = jax.memory.Space.Device, jax.memory.Space.Host
    spaces = [device] * traced.n_updates_out + [host if m else device for m in selected]
    compiled_on_host: Callable[..., list[Any]] = host_compute(
        run, compute_type="device_host", out_memory_spaces=spaces
    )

    @jax.custom_jvp
    def not_differentiable(*leaves: Any) -> list[Any]:
        return compiled_on_host(*leaves)

    not_differentiable.defjvp(_refuse_jvp, symbolic_zeros=True)  # (zeros: no derivative)
    return traced.rebuild(not_differentiable(*args))


def _refuse_jvp(primals: Any, tangents: Any) -> Any:
    """A derivative through the host computation: JAX's own would fail in its transpose
    ("Expected cotangent type float32<host>[4] but got float32[4]")."""
    raise CompositionError(
        "Differentiate through `offloaded(..., compute='device')` (the default): JAX cannot "
        "differentiate a computation on the host.\n"
        "offloaded(..., compute='host').update is differentiated (`jax.grad` or `jax.jvp` "
        "through it, as in meta-learning).\n" + see("under-vmap-and-grad")
    )

"""The donation harness of `tests/jit/test_trap.py` (ours passes) and
`tests/upstream/test_upstream_donation.py` (plain JAX and Equinox abort), and its MLP step
(also `tests/jit/test_donation.py`, `test_jit.py`, `test_aot.py`). Each run is a fresh process
(`isolated.run_isolated`): an abort must not take the suite down."""

import contextlib
import json
import warnings
from unittest import mock
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from helpers import hex_bits

import eqx_offload


STEPS = 3


def mlp_setup(offload: bool = True) -> tuple[Any, Any, Any, jax.Array]:
    """An MLP, `adamw` (offloaded or not), its state, and a (4, 3) batch: a shape no
    parameter or state leaf has, so the only input a donation can leave unused."""
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    opt = eqx_offload.offloaded(optax.adamw(1e-2)) if offload else optax.adamw(1e-2)
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    return model, opt, opt.init(eqx.filter(model, eqx.is_array)), x


def mlp_step(opt: Any, order: str = "model_state") -> Any:
    """A training step returning `(model, state, loss)`, or `(state, model, loss)`."""

    def step(model, state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return (model, state, loss) if order == "model_state" else (state, model, loss)

    return step


def unpack(out: tuple, order: str) -> tuple:
    return out if order == "model_state" else (out[1], out[0], out[2])


def state_kinds(state: Any) -> list[str]:
    """`offloaded`'s default `where`: every array but 0-d scalars is in host memory."""
    return ["pinned_host" if x.ndim >= 1 else "device" for x in jtu.tree_leaves(state)]


def harness(jit: str, donate: str, order: str, guarded: bool = False) -> dict[str, Any]:
    """`STEPS` steps of `mlp_step` (plain adamw for `jit="reference"`), jitted by `jit`,
    donating per `donate`. Without `guarded`, `offloaded`'s check for a donating plain
    `jax.jit` / `eqx.filter_jit` is patched out: what plain JAX does (the upstream
    canary; each run is a process of its own)."""
    from eqx_offload._optim import checks

    unchecked = mock.patch.object(checks, "foreign_donation", lambda: None)
    with contextlib.nullcontext() if guarded else unchecked:
        return _harness(jit, donate, order)


def _harness(jit: str, donate: str, order: str) -> dict[str, Any]:
    model, opt, state, x = mlp_setup(offload=jit != "reference")
    step = mlp_step(opt, order)
    if jit in ("jax", "reference"):
        params, static = eqx.partition(model, eqx.is_array)

        def array_step(params, state, x):
            out = step(eqx.combine(params, static), state, x)
            return tuple(eqx.filter(o, eqx.is_array) for o in out)

        argnums = {"state": (1,), "all": (0, 1, 2), "all-except-first": (1, 2), "none": ()}
        # The batch matches no output; silence that, as `eqx.filter_jit`'s "all" does.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        jitted = jax.jit(array_step, donate_argnums=argnums[donate])
        model = params
    else:
        jitted = (eqx.filter_jit if jit == "eqx" else eqx_offload.filter_jit)(step, donate=donate)
    losses = []
    for _ in range(STEPS):
        model, state, loss = unpack(jitted(model, state, x), order)
        losses.append(loss)
    return {"losses": hex_bits(losses), "params": hex_bits(eqx.filter(model, eqx.is_array))}


def harness_many(configs: list[list[str]], guarded: bool = False) -> dict[str, Any]:
    """`harness` for each `[jit, donate, order]`, in one child; with `guarded` (`offloaded`'s
    check on), a run's error is its result (its type and first words)."""
    results: dict[str, Any] = {}
    for config in configs:
        try:
            result = harness(*config, guarded=guarded)
        except Exception as e:  # (reported to the parent)
            if not guarded:
                raise
            result = {"error": type(e).__name__, "message": str(e)[:300]}
        results[json.dumps(config)] = result
    return results


# The configurations that abort (the canary tests/upstream/test_upstream_donation.py).
# Where a donated input meets an output in the other memory: with `(model, state)` outputs
# the host moments meet the device params first; with `(state, model)` the other way.
TRAPS = [
    ("jax", "state", "model_state"),
    ("jax", "all-except-first", "model_state"),
    ("jax", "all", "state_model"),
    ("eqx", "all-except-first", "model_state"),
    ("eqx", "all", "state_model"),
]

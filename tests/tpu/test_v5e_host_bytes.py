"""Every host output aliases its donated input, in every documented mode, in the v5e
plan: the host holds what the mode stores and nothing twice (issues 56 and 58). The
steps are `v5e_steps.STEPS` (a small Llama-style decoder), planned with
`eqx_offload.plan(..., target="v5e")` and `donate="all"`."""

from typing import Any

import jax
import pytest

import eqx_offload
from v5e_steps import SHAPE, STEPS  # (beside this file)


pytestmark = pytest.mark.both  # (libtpu pins its JAX: both environments)

# The documented modes that keep arrays in host memory, by the name of their step.
MODES = ("state", "state-whole", "state-bf16", "state-multisteps", "master",
         "master-params-bf16", "master-params-activations", "params-fp32", "params-bf16",
         "host-weights-bf16")


def _stored(tree: Any) -> int:
    """The bytes of `tree`'s array leaves in host memory (what the mode stores)."""
    return sum(x.nbytes for x in jax.tree.leaves(tree)
               if isinstance(x, jax.Array) and x.sharding.memory_kind == "pinned_host")


def _host_grads(name: str, args: tuple[Any, ...]) -> int:
    """An upper bound on the host temporaries a mode may add: the gradient of weights
    kept in host memory (it goes to host memory, `scan_layers`), and each layer's input
    where the mode keeps it there for the backward pass."""
    weights = _stored(args[0])
    inputs = (SHAPE.batch * SHAPE.seq * SHAPE.width * 4 * SHAPE.layers
              if "activations" in name else 0)
    return weights + inputs


@pytest.mark.parametrize("name", MODES)
def test_host_bytes_are_what_the_mode_stores(name: str) -> None:
    """No host output is written into a new buffer (each reuses its donated input's), so
    the plan's host bytes are the stored bytes (to the chip's tile padding) and the
    host temporaries of the step, which hold no second copy of what is stored."""
    step, args = STEPS[name]()
    planned = eqx_offload.plan(eqx_offload.filter_jit(step, donate="all"), *args,
                               target="v5e")
    stored = _stored(args)
    assert stored > 0
    assert planned.unaliased_host_output_bytes == 0
    assert stored <= planned.host_argument_bytes <= stored + stored // 100  # (padding)
    assert planned.host_bytes == planned.host_argument_bytes + planned.host_temp_bytes
    assert planned.host_temp_bytes <= _host_grads(name, args)
    assert "are not aliased" not in planned.summary()


def test_without_donation_the_plan_says_the_host_holds_twice() -> None:
    """The same `offloaded` step without donation writes its new state into new host
    buffers: the plan's host bytes are twice the state's, and its summary says why and
    what to do (issue 58's "twice the state's bytes in host memory")."""
    step, args = STEPS["state"]()
    planned = eqx_offload.plan(eqx_offload.filter_jit(step), *args, target="v5e")
    stored = _stored(args)
    assert planned.unaliased_host_output_bytes == stored
    assert planned.host_bytes == 2 * stored
    assert "are not aliased to donated inputs" in planned.summary()


def test_a_small_plain_step_keeps_its_temporaries_on_the_chip() -> None:
    """The small decoder's offloaded step plans HBM temporaries for its copies; the plain
    step's XLA:TPU keeps in its on-chip memory (libtpu of JAX 0.10.2: none in HBM; of JAX
    0.12, 3.7 MB), and a plan's summary says so exactly when it plans none."""
    plain_step, plain_args = STEPS["plain"]()
    state_step, state_args = STEPS["state"]()
    plain, state = (eqx_offload.plan(eqx_offload.filter_jit(step, donate="all"), *args,
                                     target="v5e")
                    for step, args in ((plain_step, plain_args), (state_step, state_args)))
    assert plain.temp_bytes < state.temp_bytes
    assert state.device_peak_bytes > plain.device_peak_bytes
    assert ("on-chip memory" in plain.summary()) == (plain.temp_bytes == 0)
    assert "on-chip memory" not in state.summary()

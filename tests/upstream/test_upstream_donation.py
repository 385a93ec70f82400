"""Canary (upstream behaviour, not the library's): the donation trap of plain JAX and
Equinox is still real.

Donating a host-resident optimizer state to plain `jax.jit(donate_argnums=...)` or
`eqx.filter_jit(donate=...)` aborts the process when JAX pairs a donated `pinned_host`
input with a device output of the same shape and dtype (or the other way round). This is
why `eqx_offload.filter_jit` exists (`tests/test_trap.py` runs it in the same harness and
it passes). If this canary fails after a JAX or Equinox upgrade, upstream has changed the
pairing: update the donation-trap section of `docs/concepts.md` and the README, and this
file. Each configuration is a fresh process.
"""

import pytest
from donation_harness import harness
from isolated import run_isolated


ABORT = "memory kind does not match sharding's memory kind"

# The configurations where plain JAX/Equinox pairs a donated input with an output in
# the other memory (measured on JAX 0.10.2 and 0.12.0.1): with `(model, state)` outputs
# the donated host moments meet the device params first; with `(state, model)` the
# donated device params meet the host moments first.
TRAPS = [
    ("jax", "state", "model_state"),
    ("jax", "all-except-first", "model_state"),
    ("jax", "all", "state_model"),
    ("eqx", "all-except-first", "model_state"),
    ("eqx", "all", "state_model"),
]


@pytest.mark.slow
@pytest.mark.parametrize("jit,donate,order", TRAPS)
def test_trap_is_real(jit, donate, order):
    process = run_isolated(harness, jit, donate, order)
    assert process.returncode != 0, (
        f"upstream canary: {jit} with donate={donate!r}, outputs {order} no longer "
        "aborts: JAX/Equinox may have fixed the donation trap. Update the docs' "
        "donation-trap section and this canary.\n" + process.stdout[-2000:]
    )
    assert ABORT in process.stderr, process.stderr[-4000:]

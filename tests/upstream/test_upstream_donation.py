"""Canary: donating a host-resident state to plain `jax.jit` or `eqx.filter_jit` still
aborts the process (a donated `pinned_host` input paired with a device output), the trap
`eqx_offload.filter_jit` avoids (`tests/jit/test_trap.py`, same harness). If this fails after
an upgrade, update the docs' donation-trap section. Each configuration is a fresh process."""

import pytest
from donation_harness import harness, TRAPS
from isolated import run_isolated


ABORT = "memory kind does not match sharding's memory kind"


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

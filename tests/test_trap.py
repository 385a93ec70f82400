"""`eqx_offload.filter_jit` donates a host-resident optimizer state safely: in the same
harness where plain `jax.jit(donate_argnums=...)` and `eqx.filter_jit(donate=...)` abort
the process (the canary `tests/upstream/test_upstream_donation.py` pins that), it gives
the results of the loop without offload, bit for bit. Each run is a fresh process."""

import json

import pytest
from donation_harness import guarded_many, harness_many, STEPS
from isolated import result_of, run_isolated


OURS = [
    ["eqx_offload", donate, order]
    for donate in ("all", "all-except-first")
    for order in ("model_state", "state_model")
]


@pytest.mark.slow
def test_ours_passes_in_the_same_harness():
    # One fresh process: the reference (no offload, no donation), ours in every
    # donation mode and output order, and -- to show the harness is sound -- plain
    # `jax.jit` and `eqx.filter_jit` with the same offloaded state but no donation.
    # All give the reference results bit for bit, so the aborts come from the
    # donation alone.
    reference = ["reference", "none", "model_state"]
    sound = [["jax", "none", "model_state"], ["eqx", "none", "state_model"]]
    results = result_of(run_isolated(harness_many, [reference, *OURS, *sound]))
    expected = results.pop(json.dumps(reference))
    assert len(set(expected["losses"])) == STEPS  # it trains
    assert len(results) == len(OURS) + len(sound)
    for config, result in results.items():
        assert result == expected, config


@pytest.mark.slow
def test_donating_plain_jits_fail_clearly_instead_of_aborting():
    # The configurations of the upstream canary (where plain JAX and Equinox abort the
    # process), with `offloaded`'s check on, as users get it: each fails while
    # tracing, with a `CompositionError` that says why and what to use, and the
    # process lives (one child for all of them).
    from upstream.test_upstream_donation import TRAPS

    results = result_of(run_isolated(guarded_many, [list(t) for t in TRAPS]))
    assert len(results) == len(TRAPS)
    for config, result in results.items():
        assert result["error"] == "CompositionError", (config, result)
        assert "traced for a jit that donates" in result["message"], (config, result)

"""`eqx_offload.filter_jit` donates a host-resident state safely: in the harness where plain
`jax.jit` and `eqx.filter_jit` abort (the canary `tests/upstream/test_upstream_donation.py`),
it gives the loop without offload, bit for bit. Each run is a fresh process."""

import json

import pytest
from donation_harness import harness_many, STEPS, TRAPS
from isolated import call_isolated


OURS = [["eqx_offload", donate, order] for donate in ("all", "all-except-first")
        for order in ("model_state", "state_model")]


@pytest.mark.slow
def test_ours_passes_in_the_same_harness():
    """The reference (no offload, no donation), ours in every donation mode and order, and
    (the harness is sound: aborts come from donation alone) undonated plain jits: all equal."""
    reference = ["reference", "none", "model_state"]
    sound = [["jax", "none", "model_state"], ["eqx", "none", "state_model"]]
    results = call_isolated(harness_many, [reference, *OURS, *sound])
    expected = results.pop(json.dumps(reference))
    assert len(set(expected["losses"])) == STEPS  # it trains
    assert len(results) == len(OURS) + len(sound)
    for config, result in results.items():
        assert result == expected, config


@pytest.mark.slow
def test_donating_plain_jits_fail_clearly_instead_of_aborting():
    """The canary's aborting configurations, with `offloaded`'s check on (as users get it):
    each fails while tracing with a `CompositionError` saying why; the process lives."""
    results = call_isolated(harness_many, [list(t) for t in TRAPS], True)
    assert len(results) == len(TRAPS)
    for config, result in results.items():
        assert result.get("error") == "CompositionError", (config, result)
        assert "traced for a jit that donates" in result["message"], (config, result)

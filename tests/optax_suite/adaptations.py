"""Which of Optax's tests are adapted, or expected to fail, with offloaded optimizers,
and why (`docs/optax-tests.md` presents these tables). Keys are patterns (`*` the only
wildcard) over a test's key (`selection.py`), and ` [message]` for a unittest subtest."""

import os
from typing import Optional

from selection import glob


# For tests that inspect the state's structure or build a state by hand. "unwrap": the test
# gets the inner state (leaves still in host memory) and `update` takes it back (a
# hand-built one too); "handmade": a hand-built state becomes the one `init` would make.

_SHADOWED = ("reads the optax combinator's own `inner_state` field, which the `inner_state` "
             "field of the OffloadedState around it shadows")
_TREE = "compares the whole state (its tree structure or key paths) with a plain one"

ADAPT: dict[str, tuple[str, str]] = {
    "transforms/_conditionality_test.py::ConditionallyTransformTest::test_statefull_inner":
        ("unwrap", _SHADOWED),
    "transforms/_conditionality_test.py::ConditionallyMaskTest::test_statefull_inner":
        ("unwrap", _SHADOWED),
    "transforms/_freezing_test.py::FreezeTest::test_freeze_updates*": ("unwrap", _SHADOWED),
    "transforms/_masking_test.py::MaskedTest::test_masked_state_structure":
        ("unwrap", _SHADOWED),
    "transforms/_masking_test.py::MaskedTest::test_tree_map_params": ("unwrap", _SHADOWED),
    "*::test_optimizers_can_be_wrapped_in_inject_hyperparams*": ("unwrap", _SHADOWED),
    "transforms/_constraining_test.py::ConstraintsTest::test_zero_nans": ("unwrap", _TREE),
    "tree_utils/_state_utils_test.py::StateUtilsTest::test_adam": ("unwrap", _TREE),
    "tree_utils/_state_utils_test.py::StateUtilsTest::test_dict_based_optimizers":
        ("unwrap", _TREE),
    "tree_utils/_state_utils_test.py::StateUtilsTest::test_inject_hparams": ("unwrap", _TREE),
    "tree_utils/_state_utils_test.py::StateUtilsTest::test_map_*": ("unwrap", _TREE),
    "tree_utils/_state_utils_test.py::StateUtilsTest::test_tree_get_all_with_path":
        ("unwrap", _TREE),
    "tree_utils/_state_utils_test.py::StateUtilsTest::test_tree_set": ("unwrap", _TREE),
    "transforms/_adding_test.py::AddingTest::test_none_argument":
        ("handmade", "passes a hand-made state to a stateless transformation"),
    "transforms/_clipping_test.py::ClippingTest::test_clip*":
        ("handmade", "passes `None` as the state of a stateless transformation"),
    "transforms/_clipping_test.py::ClippingTest::test_adaptive_grad_clip*":
        ("handmade", "passes `None` as the state of a stateless transformation"),
    "_src/transform_test.py::TransformTest::test_centralize_*":
        ("handmade", "passes `{}` as the state of a stateless transformation"),
    "_src/transform_test.py::TransformTest::test_scale":
        ("handmade", "passes `{}` as the state of a stateless transformation"),
    "contrib/_reduce_on_plateau_test.py::ReduceLROnPlateauTest::*":
        ("unwrap", "unpacks the state NamedTuple, and builds some with chosen values"),
}


# Expected failures: (reason, regex of the failure message); a pass or another failure
# is a failure (strict). A subtest's test still passes.

_RECOMPILE = ("the state from offloaded(...).init is committed (host memory) and the params "
              "are not, so plain jax.jit compiles the step twice (docs/concepts.md)")
_BASELINE = "fails without eqx_offload too (optax 0.2.8 with jax 0.10.2)"
_DONATION = ("donates the offloaded state through plain jax.jit(donate_argnums=...), where "
             "JAX may pair a host-memory input with a device output and XLA abort the "
             "process: offloaded refuses it with a CompositionError while tracing "
             "(eqx_offload.filter_jit donates safely; docs/concepts.md, the donation trap)")

XFAIL: dict[str, tuple[str, str]] = {
    # compiles twice under plain jax.jit (not polyak_sgd: nothing of its state offloaded)
    **{
        f"_src/alias_test.py::AliasTest::test_optimization* (opt_name='{name}'*"
        " [Test that optimization works]": (_RECOMPILE, r"Optimizer recompiles on second call")
        for name in ("adam", "sgd", "adafactor")
    },
    # donates the offloaded state through plain `jax.jit(donate_argnums=(0, 1))`
    "contrib/_schedule_free_test.py::ScheduleFreeTest::test_buffer_donation":
        (_DONATION, r"traced for a jit that donates"),
    # not about eqx_offload
    "transforms/_freezing_test.py::FreezeTest::test_bad_structure_raises":
        (_BASELINE + ": the error message changed", r"Dict key mismatch"),
    "transforms/_freezing_test.py::SelectiveTransformTest::test_selective_bad_structure":
        (_BASELINE + ": the error message changed", r"Dict key mismatch"),
    "transforms/_clipping_test.py::ClippingTest::test_clip_by_block_rms":
        (_BASELINE + ": 0.9999999 != 1.0 to 7 places", r"within 7 places"),
    # the plugin's own check: xfailed, failed (XPASS), failed (another message)
    "selfcheck.py::test_listed_*": ("selfcheck", r"AssertionError: selfcheck: an expected failure"),
}


def expected_failure(key: str, subtest: bool) -> Optional[tuple[str, str]]:
    """(reason, message regex) if this test or subtest (` [message]`) is expected to fail."""
    matches = (v for p, v in XFAIL.items() if (" [" in p) == subtest and glob(p, key))
    return next(matches, None)


def adaptation_for(key: str) -> str:
    """`"unwrap"`, `"handmade"` or `""`; `EQX_OFFLOAD_SUITE_ADAPT_ALL` forces one (or
    `none`) for every test, to see which need theirs."""
    forced = os.environ.get("EQX_OFFLOAD_SUITE_ADAPT_ALL")
    if forced:
        return "" if forced == "none" else forced
    return next((kind for pattern, (kind, _) in ADAPT.items() if glob(pattern, key)), "")

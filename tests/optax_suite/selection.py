"""Which of Optax's own test files run with offloaded optimizers, in which groups (each
checked on its own; paths relative to the installed `optax`), and which cases of the slow
ones. A test's key: its node id, then absl's parameters without memory addresses, e.g.
`_src/alias_test.py::AliasTest::test_optimization0 (opt_name='adam', ...)`."""

import re
from typing import Optional


GROUPS: dict[str, list[str]] = {
    # Every optimizer alias (extra arguments, MultiSteps, dtypes, ...), and L-BFGS.
    "alias": ["_src/alias_test.py"],
    # optax.contrib's common tests, and the files of the contrib wrappers that keep state.
    "contrib": [
        "contrib/_common_test.py", "contrib/_schedule_free_test.py", "contrib/_mechanic_test.py",
        "contrib/_reduce_on_plateau_test.py", "contrib/_complex_valued_test.py",
    ],
    # Combinators and stateful transforms.
    "transforms": [
        "transforms/_accumulation_test.py", "transforms/_adding_test.py",
        "transforms/_clipping_test.py", "transforms/_combining_test.py",
        "transforms/_conditionality_test.py", "transforms/_constraining_test.py",
        "transforms/_freezing_test.py", "transforms/_layouts_test.py",
        "transforms/_masking_test.py", "transforms/_monitoring_test.py",
    ],
    # Reading and writing a state: hyperparameters, tree utilities, linesearch, ...
    "state": [
        "schedules/_inject_test.py", "tree_utils/_state_utils_test.py", "_src/lookahead_test.py",
        "_src/transform_test.py", "_src/combine_test.py", "_src/linesearch_test.py",
        "experimental/_aggregating_test.py",
    ],
}

# Cases of the slow tests that run: node-id pattern (the longest matching applies) -> a
# regex the parameters must match (`re.search`), or `None` for none. Unlisted tests run.
_ALIASES = "adam|adamw|sgd|polyak_sgd|adafactor|lion|noisy_sgd|sm3|rprop"
_CONTRIB = "momo|momo_adam|prodigy|schedule_free_adamw|sophia|muon|dadapt_adamw|galore"
SUBSETS: dict[str, Optional[str]] = {
    # 10,000 jitted steps per case: convergence of a few, on the parabola.
    "_src/alias_test.py::AliasTest::test_optimization*":
        r"opt_name='(adam|sgd|polyak_sgd|adafactor)'.*_setup_parabola.*float32",
    "_src/alias_test.py::AliasTest::test_optimizers_can_be_wrapped_in_inject_hyperparams*":
        rf"opt_name='({_ALIASES})'",
    # MultiSteps, jitted: the aliases whose states differ in kind (a PRNG key, factored or
    # 0-d leaves, extra arguments); every alias goes through `test_optimizers_accept_extra_args`.
    "_src/alias_test.py::AliasTest::test_gradient_accumulation*":
        rf"opt_name='({_ALIASES})'.*dtype='float32'",
    "_src/alias_test.py::AliasTest::test_preserve_dtype*": rf"opt_name='({_ALIASES})'.*bfloat16",
    "_src/alias_test.py::AliasTest::test_explicit_dtype*": r"opt_name='(adam|sgd|adamw)'",
    "_src/alias_test.py::AliasTest::test_state_shape_dtype_shard_stability*":
        r"opt_name='(adam|sgd|polyak_sgd|adafactor|noisy_sgd)'.*dtype=<class 'jax.numpy.float32'>",
    # L-BFGS: its own state and extra arguments; the slow solver comparisons do not run.
    "_src/alias_test.py::LBFGSTest::test_against_*": None,
    "_src/alias_test.py::LBFGSTest::test_*logreg*": None,
    "_src/alias_test.py::LBFGSTest::test_lbfgs_complex*": None,
    "_src/alias_test.py::LBFGSTest::test_preconditioning_by_lbfgs_on_*": r"idx=0",
    "_src/alias_test.py::LBFGSTest::test_state_shape_dtype_shard_stability*": r"float32",
    "_src/alias_test.py::LBFGSTest::test_steep_objective": None,
    "_src/alias_test.py::LBFGSTest::test_minimize_bad_initialization": None,
    # 30,000 scanned steps per case: those that need extra arguments or read their state.
    "contrib/_common_test.py::ContribTest::test_optimizers*":
        r"(opt_name='(momo|schedule_free_adamw)'|wrapper_name='(schedule_free|reduce_on_plateau)')"
        r".*_setup_parabola",
    # The wrappers around sgd, and mechanize around sgd with momentum and adam (`alias`
    # runs the other aliases' states through `offloaded` with extra arguments).
    "contrib/_common_test.py::ContribTest::test_optimizers_accept_extra_args*":
        rf"(opt_name='({_CONTRIB})'|opt_name='(sgd|adam)'.*wrapper_name='[a-z_]+')"
        r".*wrap=True",
    "contrib/_common_test.py::ContribTest::test_optimizers_can_be_wrapped_in_inject_hyperparams*":
        rf"opt_name='({_CONTRIB})'|wrapper_name='[a-z_]+'",
    "contrib/_common_test.py::ContribTest::test_state_shape_dtype_shard_stability*":
        r"opt_name='(momo|prodigy|sophia|muon)'.*wrapper_name=None.*float32",
    "contrib/_common_test.py::ContribTest::test_gradient_accumulation*":
        rf"(opt_name='({_CONTRIB})'|wrapper_name='[a-z_]+').*float32",
    "contrib/_common_test.py::ContribTest::test_preserve_dtype*":
        rf"opt_name='({_CONTRIB})'.*bfloat16",
    "contrib/_common_test.py::ContribTest::test_optimizers_accept_learning_rate_schedule*":
        r"opt_name='(momo|prodigy|schedule_free_adamw)'",
    # MultiSteps with mixed precision: plain adam only (9 dtype pairs, eagerly: slow).
    "transforms/_accumulation_test.py::AccumulationTest::test_multi_steps_mixed_precision*":
        r"opt_name='adam', opt_kwargs=\{'learning_rate': 0.1\}\)$",
    # Linesearch: the update path (extra arguments), not every line-search problem.
    "_src/linesearch_test.py::BacktrackingLinesearchTest::test_linesearch*": None,
    "_src/linesearch_test.py::*::test_dtype_stability*": r"float32",
    "_src/linesearch_test.py::ZoomLinesearchTest::test_failure_*": None,
}


def glob(pattern: str, key: str) -> bool:
    """`fnmatch` with only `*` as a wildcard (keys contain `[` and `]`)."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), key, re.S) is not None


def selected(nodeid: str, params: str) -> bool:
    """Whether the test with this node id and parameters runs."""
    patterns = [p for p in SUBSETS if glob(p, nodeid)]
    if not patterns:
        return True
    regex = SUBSETS[max(patterns, key=len)]
    return regex is not None and re.search(regex, params) is not None

"""A pytest plugin that runs Optax's own tests with every optimizer wrapped in
`eqx_offload.offloaded`; loaded only in the child pytest of `tests/test_optax_suite.py`.

Before optax's test modules load, each public optax function that may build a
transformation is replaced, in every optax module, by a wrapper: a call from test code
(not from inside optax) that returns a `GradientTransformation` returns `offloaded(...)`
of it, after unwrapping wrapped arguments, so each optimizer is offloaded exactly once,
outermost (`optax.MultiSteps` by a subclass; `inject_hyperparams`'s factory too). Every
eager `init`/`update` checks the default placement (`ndim >= 1` in `pinned_host`, 0-d and
a line search's `grad` on the device). `adaptations.py` lists the expected failures;
`EQX_OFFLOAD_SUITE_REPORT` names the JSON report (per test: optimizers wrapped, states
checked; outcomes).
"""

import contextlib
import functools
import inspect
import json
import os
import re
import sys
from typing import Any

import pytest


_state = {"depth": 0}
# id(wrapped transformation) -> (wrapped, original): kept alive so ids are not reused.
_originals: dict[int, tuple[Any, Any]] = {}
_counts = {"wrapped": 0, "checked": 0}
_per_test: dict[str, dict[str, int]] = {}
# The adaptation of the running test: "", "unwrap" or "handmade".
_adaptation: list[str] = [""]


@contextlib.contextmanager
def _inside_optax() -> Any:
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1


def _unwrap(x: Any) -> Any:
    """`x` with every wrapped transformation replaced by its original, including one
    rebuilt by the test from a wrapped one's `init`/`update` (optax's tests do
    `GradientTransformationExtraArgs(opt.init, functools.partial(opt.update, ...))`)."""
    entry = _originals.get(id(x))
    if entry is not None and entry[0] is x:
        return entry[1]
    if isinstance(x, functools.partial):
        func = _unwrap(x.func)
        return x if func is x.func else functools.partial(func, *x.args, **x.keywords)
    import optax

    if type(x) in (optax.GradientTransformation, optax.GradientTransformationExtraArgs):
        init, update = _unwrap(x.init), _unwrap(x.update)
        if init is not x.init or update is not x.update:
            return type(x)(init, update)
        return x
    if type(x) in (list, tuple):
        return type(x)(_unwrap(y) for y in x)
    if type(x) is dict:
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _check_placement(state: Any, where: str) -> None:
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    arrays = [(p, x) for p, x in leaves if isinstance(x, jax.Array)]
    if not arrays or any(isinstance(x, jax.core.Tracer) for _, x in arrays):
        return
    for path, x in arrays:
        if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
            continue  # a typed key with ndim 0 stays on the device; no shape to check
        grad = any(getattr(k, "name", None) == "grad" for k in path)  # a line search's
        want = "pinned_host" if x.ndim >= 1 and not grad else "device"
        got = x.sharding.memory_kind
        assert got == want, (
            f"eqx_offload suite: after {where}, state leaf {jax.tree_util.keystr(path)} "
            f"({x.dtype}{list(x.shape)}) is in {got!r}, expected {want!r}"
        )
    _counts["checked"] += 1


def _offload(original: Any) -> Any:
    """`offloaded(original)` whose `init`/`update` run at depth > 0, check a concrete
    state's placement and apply the test's adaptation (`adaptations.py`)."""
    import jax
    import optax

    import eqx_offload

    DEFAULT_WHERE = inspect.signature(eqx_offload.offloaded).parameters["where"].default

    with _inside_optax():
        inner = eqx_offload.offloaded(original, **_options())

    def adopt(state: Any, updates: Any, params: Any) -> Any:
        """A state built by hand or unwrapped, as the `OffloadedState` `init` would make."""
        if isinstance(state, eqx_offload.OffloadedState):
            return state
        expected = jax.eval_shape(original.init, updates if params is None else params)
        if jax.tree.structure(state) != jax.tree.structure(expected):
            # `None`, `{}` or `()` for a stateless transformation: its own state.
            assert not jax.tree.leaves(expected), (
                f"eqx_offload suite: a hand-made state {state!r} for a stateful "
                f"transformation that expects {expected!r}"
            )
            return inner.init(updates if params is None else params)
        return eqx_offload.OffloadedState(eqx_offload.to_host(state, DEFAULT_WHERE))

    def init(params: Any) -> Any:
        with _inside_optax():
            state = inner.init(params)
        _check_placement(state, "init")
        return state.inner_state if _adaptation[0] == "unwrap" else state

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        with _inside_optax():
            if _adaptation[0]:
                state = adopt(state, updates, params)
            updates, state = inner.update(updates, state, params, **extra)
        _check_placement(state, "update")
        return updates, state.inner_state if _adaptation[0] == "unwrap" else state

    # A subclass callers dispatch on (`optax.experimental.Aggregator`) keeps its type.
    cls = type(original)
    if not issubclass(cls, optax.GradientTransformationExtraArgs):
        cls = optax.GradientTransformationExtraArgs
    wrapped = cls(init, update)
    _originals[id(wrapped)] = (wrapped, original)
    _originals[id(init)] = (init, original.init)
    _originals[id(update)] = (update, original.update)
    _counts["wrapped"] += 1
    return wrapped


_MODES: dict[str, dict[str, Any]] = {
    "default": {}, "streamed": {"group_bytes": 0}, "host": {"compute": "host"}}


def _options() -> dict[str, Any]:
    return _MODES[os.environ.get("EQX_OFFLOAD_SUITE_MODE", "default")]


def _wrap_factory(fn: Any, returns_factory: bool = False) -> Any:
    import optax

    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if _state["depth"]:
            return fn(*args, **kwargs)
        with _inside_optax():
            result = fn(*_unwrap(args), **_unwrap(kwargs))
        if isinstance(result, optax.GradientTransformation):
            return _offload(result)
        if returns_factory and callable(result):
            return _wrap_factory(result)
        return result

    factory._eqx_offload_original = fn  # type: ignore[attr-defined]  # marks a wrapper
    return factory


def _multi_steps_class() -> type:
    import optax

    original = optax.MultiSteps

    class MultiSteps(original):  # type: ignore[misc,valid-type]  # a class from a variable
        """`optax.MultiSteps` whose `init`/`update` are those of
        `offloaded(MultiSteps(...))` when built from test code."""

        def __init__(self, opt: Any, *args: Any, **kwargs: Any) -> None:
            outer = not _state["depth"]
            with _inside_optax():
                super().__init__(_unwrap(opt), *args, **kwargs)
                self._offloaded = None
                if outer:
                    base = optax.GradientTransformationExtraArgs(
                        functools.partial(original.init, self),
                        functools.partial(original.update, self),
                    )
                    self._offloaded = _offload(base)

        def init(self, params: Any) -> Any:
            if self._offloaded is None:
                return super().init(params)
            return self._offloaded.init(params)

        def update(self, updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
            if self._offloaded is None:
                return super().update(updates, state, params, **extra)
            return self._offloaded.update(updates, state, params, **extra)

        def gradient_transformation(self) -> Any:
            if self._offloaded is None:
                return super().gradient_transformation()
            return optax.GradientTransformation(self.init, self.update)

    MultiSteps.__name__ = MultiSteps.__qualname__ = "MultiSteps"
    MultiSteps.__module__ = original.__module__
    return MultiSteps


_RETURNS_FACTORY = {"inject_hyperparams", "inject_stateful_hyperparams"}


def _is_candidate(fn: Any) -> bool:
    if not inspect.isfunction(fn) or not fn.__module__.startswith("optax"):
        return False
    if fn.__module__.endswith("_test") or fn.__name__.startswith("_"):
        return False
    try:
        returns = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):
        return False
    return returns is inspect.Signature.empty or "Transformation" in str(returns)


def install() -> int:
    """Patches optax; returns how many functions were wrapped."""
    import optax
    import optax.contrib
    import optax.experimental
    import optax.schedules
    import optax.transforms
    import optax.tree_utils

    modules = [m for n, m in list(sys.modules.items())
               if (n == "optax" or n.startswith("optax.")) and not n.endswith("_test")
               and m is not None]
    wrappers: dict[int, Any] = {}
    multi_steps = _multi_steps_class()
    original_multi_steps = optax.MultiSteps
    for module in modules:
        for name, value in list(vars(module).items()):
            if value is original_multi_steps:
                setattr(module, name, multi_steps)
            elif _is_candidate(value):
                if id(value) not in wrappers:
                    wrappers[id(value)] = _wrap_factory(value, value.__name__ in _RETURNS_FACTORY)
                setattr(module, name, wrappers[id(value)])
    return len(wrappers)


# ---------------------------------------------------------------------------------------
# pytest hooks

_installed_key = pytest.StashKey[int]()
_keys: dict[str, str] = {}  # node id -> key (node id and absl parameters)
_outcomes: dict[str, str] = {}  # key (with " [subtest]") -> outcome


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("numprocesses", None):
        # The bookkeeping runs where the tests run: under xdist the report would be empty.
        raise pytest.UsageError("run the eqx_offload optax suite with -n 0")
    config.stash[_installed_key] = install()


def _params_of(item: pytest.Item) -> str:
    from selection import params_repr

    cls = getattr(item, "cls", None)
    raw = getattr(cls, "_test_params_reprs", {}).get(item.name, "")
    return params_repr(raw)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from selection import selected

    keep, drop = [], []
    for item in items:
        params = _params_of(item)
        _keys[item.nodeid] = f"{item.nodeid} {params}".rstrip()
        (keep if selected(item.nodeid, params) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    from adaptations import adaptation_for

    before = dict(_counts)
    _adaptation[0] = adaptation_for(_keys.get(item.nodeid, item.nodeid))
    try:
        return (yield)
    finally:
        _adaptation[0] = ""
        _per_test[_keys.get(item.nodeid, item.nodeid)] = {
            k: _counts[k] - before[k] for k in _counts
        }


def _crash_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    return crash.message if crash is not None else str(report.longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> Any:
    """`adaptations.XFAIL` per test or subtest: a matching failure becomes an xfail, a
    pass or another failure a failure (strict); a wrapper, so no other plugin sees the
    report before."""
    if report.when == "call":
        _expect(report)
    return (yield)


def _expect(report: pytest.TestReport) -> None:
    from adaptations import expected_failure

    key = _keys.get(report.nodeid, report.nodeid)
    context = getattr(report, "context", None)
    if context is not None:  # a subtest
        key = f"{key} [{context.msg}]"
    expected = expected_failure(key, subtest=context is not None)
    if expected is not None:
        reason, message = expected
        if report.failed and re.search(message, _crash_message(report)):
            report.outcome = "skipped"
            report.wasxfail = reason  # type: ignore[attr-defined]  # how pytest marks an xfail
        elif report.passed:
            report.outcome = "failed"
            report.longrepr = f"[XPASS(strict)] {reason}"
        elif report.failed:
            report.longrepr = (
                f"expected to fail with /{message}/ ({reason}), failed with "
                f"{_crash_message(report)!r}\n{report.longrepr}"
            )
    outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    if context is None or outcome != "passed" or key not in _outcomes:
        _outcomes[key] = outcome
        if report.failed:
            _outcomes[key] = "failed: " + _crash_message(report)[:500]


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("EQX_OFFLOAD_SUITE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({
                "patched_functions": session.config.stash.get(_installed_key, 0),
                "counts": _per_test,
                "outcomes": _outcomes,
            }, f, indent=1)

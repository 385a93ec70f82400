"""A pytest plugin that runs Optax's own tests with every optimizer wrapped in
`eqx_offload.offloaded` (in the child pytest of `tests/optim/test_optax_suite.py`).

Each public optax factory, called from test code, returns `offloaded(...)` of its
transformation after unwrapping wrapped arguments: each optimizer is offloaded once,
outermost (`MultiSteps` by a subclass). Every eager `init`/`update` checks the placement
(`ndim >= 1` in `pinned_host`; 0-d and a line search's `grad` on the device).
`EQX_OFFLOAD_SUITE_REPORT` names the JSON report (per test: optimizers wrapped, states
checked; outcomes)."""

import contextlib
import functools
import importlib
import inspect
import json
import os
import re
import sys
from typing import Any

import jax
import optax
import pytest
from adaptations import adaptation_for, expected_failure
from selection import selected

import eqx_offload


# How deep in optax's own calls; the running test's adaptation ("", "unwrap", "handmade").
_state: dict[str, Any] = {"depth": 0, "adaptation": ""}
# id(wrapped transformation) -> (wrapped, original): kept alive so ids are not reused.
_originals: dict[int, tuple[Any, Any]] = {}
_counts = {"wrapped": 0, "checked": 0}
_per_test: dict[str, dict[str, int]] = {}
# `offloaded`'s options, by `EQX_OFFLOAD_SUITE_MODE`.
_MODES: dict[str, dict[str, Any]] = {
    "default": {}, "streamed": {"group_bytes": 0}, "host": {"compute": "host"}}
_DEFAULT_WHERE = inspect.signature(eqx_offload.offloaded).parameters["where"].default


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
    if type(x) in (optax.GradientTransformation, optax.GradientTransformationExtraArgs):
        init, update = _unwrap(x.init), _unwrap(x.update)
        return x if init is x.init and update is x.update else type(x)(init, update)
    if type(x) in (list, tuple):
        return type(x)(_unwrap(y) for y in x)
    if type(x) is dict:
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _check_placement(state: Any, where: str) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    arrays = [(p, x) for p, x in leaves if isinstance(x, jax.Array)]
    if not arrays or any(isinstance(x, jax.core.Tracer) for _, x in arrays):
        return
    for path, x in arrays:
        if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
            continue  # a typed key with ndim 0 stays on the device; no shape to check
        grad = any(getattr(k, "name", None) == "grad" for k in path)  # a line search's
        want = "pinned_host" if x.ndim >= 1 and not grad else "device"
        assert x.sharding.memory_kind == want, (
            f"eqx_offload suite: after {where}, state leaf {jax.tree_util.keystr(path)} "
            f"({x.dtype}{list(x.shape)}) is in {x.sharding.memory_kind!r}, expected {want!r}"
        )
    _counts["checked"] += 1


def _offload(original: Any) -> Any:
    """`offloaded(original)` whose `init`/`update` run at depth > 0, check a concrete
    state's placement and apply the test's adaptation (`adaptations.py`)."""
    options = _MODES[os.environ.get("EQX_OFFLOAD_SUITE_MODE", "default")]
    with _inside_optax():
        inner = eqx_offload.offloaded(original, **options)

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
        return eqx_offload.OffloadedState(eqx_offload.to_host(state, _DEFAULT_WHERE))

    def init(params: Any) -> Any:
        with _inside_optax():
            state = inner.init(params)
        _check_placement(state, "init")
        return state.inner_state if _state["adaptation"] == "unwrap" else state

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        with _inside_optax():
            if _state["adaptation"]:
                state = adopt(state, updates, params)
            updates, state = inner.update(updates, state, params, **extra)
        _check_placement(state, "update")
        return updates, state.inner_state if _state["adaptation"] == "unwrap" else state

    # A subclass callers dispatch on (`optax.experimental.Aggregator`) keeps its type.
    cls = type(original)
    if not issubclass(cls, optax.GradientTransformationExtraArgs):
        cls = optax.GradientTransformationExtraArgs
    wrapped = cls(init, update)
    for new, old in ((wrapped, original), (init, original.init), (update, original.update)):
        _originals[id(new)] = (new, old)
    _counts["wrapped"] += 1
    return wrapped


def _wrap_factory(fn: Any, returns_factory: bool = False) -> Any:
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

    return factory


_OptaxMultiSteps = optax.MultiSteps


class _MultiSteps(_OptaxMultiSteps):
    """`optax.MultiSteps` whose `init`/`update` (and `gradient_transformation`'s) are those
    of `offloaded(MultiSteps(...))` when built from test code."""

    def __init__(self, opt: Any, *args: Any, **kwargs: Any) -> None:
        outer = not _state["depth"]
        with _inside_optax():
            super().__init__(_unwrap(opt), *args, **kwargs)
            # Partials, not bound methods: `offloaded` would see a MultiSteps through those.
            own = optax.GradientTransformationExtraArgs(
                functools.partial(_OptaxMultiSteps.init, self),
                functools.partial(_OptaxMultiSteps.update, self),
            )
            self._impl = _offload(own) if outer else own

    def init(self, params: Any) -> Any:
        return self._impl.init(params)

    def update(self, updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        return self._impl.update(updates, state, params, **extra)


_MultiSteps.__name__ = _MultiSteps.__qualname__ = "MultiSteps"
_MultiSteps.__module__ = _OptaxMultiSteps.__module__


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
    for submodule in ("contrib", "experimental", "schedules", "transforms", "tree_utils"):
        importlib.import_module(f"optax.{submodule}")  # loaded, to be patched

    modules = [m for n, m in list(sys.modules.items())
               if (n == "optax" or n.startswith("optax.")) and not n.endswith("_test")
               and m is not None]
    wrappers: dict[int, Any] = {}
    for module in modules:
        for name, value in list(vars(module).items()):
            if value is _OptaxMultiSteps:
                setattr(module, name, _MultiSteps)
            elif _is_candidate(value):
                if id(value) not in wrappers:
                    wrappers[id(value)] = _wrap_factory(value, value.__name__ in _RETURNS_FACTORY)
                setattr(module, name, wrappers[id(value)])
    return len(wrappers)


# pytest hooks
_installed_key = pytest.StashKey[int]()
_keys: dict[str, str] = {}  # node id -> key (node id and absl parameters)
_outcomes: dict[str, str] = {}  # key (with " [subtest]") -> outcome


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("numprocesses", None):
        # The bookkeeping runs where the tests run: under xdist the report would be empty.
        raise pytest.UsageError("run the eqx_offload optax suite with -n 0")
    config.stash[_installed_key] = install()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        raw = getattr(getattr(item, "cls", None), "_test_params_reprs", {}).get(item.name, "")
        params = re.sub(r" at 0x[0-9a-f]+", "", raw)  # absl's, without memory addresses
        _keys[item.nodeid] = f"{item.nodeid} {params}".rstrip()
        (keep if selected(item.nodeid, params) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    key, before = _keys.get(item.nodeid, item.nodeid), dict(_counts)
    _state["adaptation"] = adaptation_for(key)
    try:
        return (yield)
    finally:
        _state["adaptation"] = ""
        _per_test[key] = {k: _counts[k] - before[k] for k in _counts}


def _crash_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    return crash.message if crash is not None else str(report.longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> Any:
    """`adaptations.XFAIL` per test or subtest: a matching failure becomes an xfail, a
    pass or another failure a failure (strict); a wrapper, so no other plugin sees the
    report before."""
    if report.when != "call":
        return (yield)
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
    return (yield)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("EQX_OFFLOAD_SUITE_REPORT")
    patched = session.config.stash.get(_installed_key, 0)
    if path:
        with open(path, "w") as f:
            json.dump({"patched_functions": patched, "counts": _per_test, "outcomes": _outcomes},
                      f, indent=1)

"""The type checkers really check, statically and at run time.

Static: mypy --strict (reading the package's inline types, as a downstream mypy user
does) and pytype (reading `typings/`, as a downstream pytype user does) run over
`tests/types/`. `good_usage.py` must pass both without an error; in each `bad_*.py`
every line marked `# expect: mypy=CODE pytype=CODE` must be reported by that checker with
that code, and nothing else may be reported. So a stub that decays to `Any`, a checker
that stops reading the stubs, or a signature that loosens makes these tests fail.

Run time: with beartype through jaxtyping's import hook (pytest installs it for the
package, see `--jaxtyping-packages` in pyproject.toml), the same mistakes made at run time
raise errors that name the argument and what was expected.

Also here, as slow tests: the pytype gate fails on a module with a type error, and the
stub-drift check fails when a public signature changes without its stub.
"""

import collections
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys
import time
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import optax
import pytest
from beartype import beartype

import eqx_offload
from eqx_offload import Nested


ROOT = pathlib.Path(__file__).resolve().parent.parent
TYPES = ROOT / "tests" / "types"
GOOD = TYPES / "good_usage.py"
BAD = sorted(TYPES.glob("bad_*.py"))
CHECKERS = ("mypy", "pytype")

_EXPECT = re.compile(r"#\s*expect:\s*(?P<spec>((mypy|pytype)=[a-z-]+\s*)+)$")
_MYPY_ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")


def _load_script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_errors(path: pathlib.Path) -> dict[str, set[tuple[int, str]]]:
    """{checker: {(line, code)}} from the `# expect:` comments of `path`."""
    found: dict[str, set[tuple[int, str]]] = {c: set() for c in CHECKERS}
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        match = _EXPECT.search(text)
        if match is None:
            continue
        for item in match["spec"].split():
            checker, _, code = item.partition("=")
            assert checker in CHECKERS and code, f"{path.name}:{number}: bad expect {item!r}"
            found[checker].add((number, code))
    return found


def _run_mypy(paths: list[pathlib.Path]) -> dict[str, set[tuple[int, str]]]:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini"),
         "--cache-dir", str(ROOT / ".mypy_cache" / "types-tests"),
         "--no-error-summary", "--hide-error-context", "--no-pretty",
         *map(str, paths)],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    errors: dict[str, set[tuple[int, str]]] = collections.defaultdict(set)
    for line in proc.stdout.splitlines():
        match = _MYPY_ERROR.match(line)
        if match is not None:
            errors[pathlib.Path(match["file"]).name].add((int(match["line"]), match["code"]))
        else:
            assert ": note: " in line or not line.strip(), f"unparsed mypy output: {line}"
    return errors


def _run_pytype(paths: list[pathlib.Path]) -> dict[str, set[tuple[int, str]]]:
    gate = _load_script("pytype_gate")
    errors: dict[str, set[tuple[int, str]]] = collections.defaultdict(set)
    for result in gate.check_files(paths, jobs=2):
        assert result.returncode in (0, 1), result.output
        found = gate.errors_of(result.output)
        if result.returncode == 1:
            assert found, f"pytype failed without reporting an error:\n{result.output}"
        errors[pathlib.Path(result.target).name] = set(found)
    return errors


# One test per checker, each running its checker once over every file: with
# `pytest -n 2` a fixture shared by several tests would run once per worker.
@pytest.mark.slow
@pytest.mark.parametrize("checker", CHECKERS)
def test_checker_reports_exactly_the_expected_errors(checker: str) -> None:
    paths = [GOOD, *BAD]
    reported = _run_mypy(paths) if checker == "mypy" else _run_pytype(paths)
    problems = []
    good = reported.get(GOOD.name, set())
    if good:
        problems.append(f"{GOOD.name}: errors {sorted(good)}")
    for path in BAD:
        expected = expected_errors(path)[checker]
        got = reported.get(path.name, set())
        assert expected, f"{path.name} expects no {checker} error: the test would be vacuous"
        if got - expected:
            problems.append(f"{path.name}: unexpected {sorted(got - expected)}")
        if expected - got:
            problems.append(f"{path.name}: missed {sorted(expected - got)}")
    assert problems == [], f"{checker}:\n" + "\n".join(problems)


def test_bad_usage_covers_the_listed_mistakes() -> None:
    mistakes = {
        (path.name, line)
        for path in BAD
        for checker in CHECKERS
        for line, _ in expected_errors(path)[checker]
    }
    assert len(mistakes) >= 8
    text = "\n".join(p.read_text() for p in BAD)
    for needle in ('memory_kind="gpu"', "offloaded(optax.adam)", "offloaded(model)",
                   "opt.update(grads, opt, params)", 'donate="everything"', 'where=".*/w"',
                   "where=1024", 'return "mu"'):
        assert needle in text, needle
    # Both checkers catch all but a handful (mypy: jax.Device is untyped for it; pytype:
    # it does not look inside a dict literal passed to a union).
    for checker in CHECKERS:
        caught = {(p.name, line) for p in BAD for line, _ in expected_errors(p)[checker]}
        assert len(caught) >= len(mistakes) - 2, checker


def test_good_usage_uses_every_public_name() -> None:
    drift = _load_script("stub_drift")
    public = drift.runtime_public_names()
    text = GOOD.read_text()
    used = set(re.findall(r"eqx_offload\.(\w+)", text))
    imported = re.search(r"from eqx_offload import ([\w, ]+)", text)
    assert imported is not None
    used |= {n.strip() for n in imported[1].split(",")}
    assert public - used == set()


def test_good_usage_runs() -> None:
    spec = importlib.util.spec_from_file_location("good_usage", GOOD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loss = module.train(steps=2)
    assert jnp.isfinite(loss)


# ----------------------------------------------------------------------------- run time


PARAMS = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}


def _step(x: jax.Array) -> jax.Array:
    return x * 2


def _model() -> eqx.nn.Linear:
    return eqx.nn.Linear(4, 4, key=jax.random.key(0))


RUNTIME_MISTAKES = {
    "memory kind gpu": (lambda: eqx_offload.to_host(PARAMS, memory_kind="gpu"),
                        "memory_kind", "pinned_host"),
    "device memory for offloaded": (
        lambda: eqx_offload.offloaded(optax.adam(1e-3), memory_kind="device"),
        "memory_kind", "unpinned_host"),
    "memory kind for to_device": (
        lambda: eqx_offload.to_device(PARAMS, memory_kind="device"), "memory_kind", None),
    "platform name for a device": (lambda: eqx_offload.supported_memory_kinds("cpu"),
                                   "device", "Device"),
    "optimizer factory": (lambda: eqx_offload.offloaded(optax.adam),
                          "inner", "GradientTransformation"),
    "model for a transformation": (lambda: eqx_offload.offloaded(_model()),
                                   "inner", "GradientTransformation"),
    "transformation as its state": (
        lambda: (lambda opt: opt.update(PARAMS, opt, PARAMS))(
            eqx_offload.offloaded(optax.adam(1e-3))),
        "state", "OffloadedState"),
    "compute tpu": (lambda: eqx_offload.offloaded(optax.adam(1e-3), compute="tpu"),
                    "compute", "'host'"),
    "group_bytes string": (
        lambda: eqx_offload.offloaded(optax.adam(1e-3), group_bytes="1MiB"),
        "group_bytes", "int"),
    "string where": (lambda: eqx_offload.to_host(PARAMS, where=".*/w"), "where", "Callable"),
    "int where": (lambda: eqx_offload.to_device(PARAMS, where=1024), "where", "Callable"),
    "min_bytes string": (lambda: eqx_offload.min_bytes("1MiB"), "nbytes", "int"),
    "pattern int": (lambda: eqx_offload.pattern(0), "regex", "str"),
    "string in a where prefix": (
        lambda: eqx_offload.to_host(PARAMS, where={"w": True, "b": "yes"}), "where", "filter"),
    "donate mode": (lambda: eqx_offload.filter_jit(_step, donate="everything"),
                    "donate", "all-except-first"),
    "donate bool": (lambda: eqx_offload.filter_jit(donate=True), "donate", "all-except-first"),
}


@pytest.mark.parametrize("name", sorted(RUNTIME_MISTAKES))
def test_runtime_mistake_names_argument_and_expectation(name: str) -> None:
    call, argument, expected = RUNTIME_MISTAKES[name]
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    message = str(info.value)
    assert argument in message
    if expected is not None:
        assert expected in message


def test_runtime_checks_are_on_for_the_package() -> None:
    # beartype, not the library's own validation, rejects a string `where`: the hook is
    # installed and `Where` resolves at run time (a string forward reference in
    # `Nested` would make jaxtyping replace the whole annotation by `Any`).
    with pytest.raises(jaxtyping.TypeCheckError, match="where"):
        eqx_offload.to_host(PARAMS, where="w")
    with pytest.raises(jaxtyping.TypeCheckError, match="memory_kind"):
        eqx_offload.to_host(PARAMS, memory_kind="gpu")


@jaxtyping.jaxtyped(typechecker=beartype)
def _moments(value: Any) -> Nested[jax.Array]:
    out: Nested[jax.Array] = value
    return out


@jaxtyping.jaxtyped(typechecker=beartype)
def _select(tree: Any, where: eqx_offload.Where) -> Any:
    return eqx_offload.to_host(tree, where)


def test_beartype_checks_nested_in_user_code() -> None:
    # What the import hook does to a user's module: `Nested` resolves at run time.
    adam = optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=PARAMS, nu=PARAMS)
    nested = (adam, (PARAMS["w"], [PARAMS["b"]]), {"w": PARAMS["w"]})
    assert _moments(nested) is nested
    with pytest.raises(jaxtyping.TypeCheckError, match="return") as info:
        _moments("mu")
    assert "Array" in str(info.value)
    with pytest.raises(jaxtyping.TypeCheckError):
        _moments({"a": "mu"})  # the second level is checked too (deeper ones are not)
    assert _moments({"a": ["mu"]}) == {"a": ["mu"]}
    tree = {"w": jnp.ones((4, 4)), "opt": adam}
    out = _select(tree, {"w": True, "opt": eqx_offload.min_ndim(1)})
    assert out["w"].sharding.memory_kind == "pinned_host"
    assert out["opt"].mu["w"].sharding.memory_kind == "pinned_host"
    assert out["opt"].count.sharding.memory_kind == "device"
    with pytest.raises(jaxtyping.TypeCheckError, match="where"):
        _select(tree, 3)


def test_hooked_calls_decorate_nothing_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # The import hook decorates every function, nested ones included, when its `def`
    # runs: a function nested in a hot path would be re-decorated (beartype compiles a
    # wrapper, ~2 ms) on every call. An eager `to_host` and a compiled step must not.
    import jaxtyping._decorator as decorator

    opt = eqx_offload.offloaded(optax.adam(1e-3))
    state = opt.init(PARAMS)

    @eqx_offload.filter_jit(donate="none")
    def step(params: Any, state: Any) -> Any:
        return opt.update(params, state, params)

    step(PARAMS, state)
    eqx_offload.to_host(PARAMS, where={"w": True, "b": eqx_offload.min_ndim(1)})
    decorated: list[str] = []
    original = decorator._apply_typechecker

    def counting(typechecker: Any, fn: Any) -> Any:
        decorated.append(getattr(fn, "__qualname__", repr(fn)))
        return original(typechecker, fn)

    monkeypatch.setattr(decorator, "_apply_typechecker", counting)
    for _ in range(2):
        step(PARAMS, state)
        eqx_offload.to_host(PARAMS, where={"w": True, "b": eqx_offload.min_ndim(1)})
        eqx_offload.to_device(PARAMS)
    assert decorated == []


# ----------------------------------------------------------------------------- the gates


def _copy_repo(tmp_path: pathlib.Path) -> pathlib.Path:
    for name in ("eqx_offload", "scripts"):
        shutil.copytree(ROOT / name, tmp_path / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.slow
def test_pytype_gate_fails_on_a_type_error(tmp_path: pathlib.Path) -> None:
    repo = _copy_repo(tmp_path)
    memory = repo / "eqx_offload" / "_memory.py"
    source = memory.read_text()
    assert "\ndef default_device() -> jax.Device:\n" in source
    memory.write_text(source + "\n\ndef _broken() -> str:\n    return jax.local_devices()\n")
    proc = subprocess.run(
        [sys.executable, str(repo / "scripts" / "pytype_gate.py"), str(memory)],
        capture_output=True, text=True, cwd=repo,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "eqx_offload/_memory.py" in proc.stdout and "FAILED (1 error)" in proc.stdout
    assert "[bad-return-type]" in proc.stdout


@pytest.mark.slow
def test_stub_drift_fails_when_a_signature_changes(tmp_path: pathlib.Path) -> None:
    repo = _copy_repo(tmp_path)
    move = repo / "eqx_offload" / "_move.py"
    source = move.read_text()
    old = "def to_device(tree: _T, where: Where = True) -> _T:"
    assert old in source
    move.write_text(source.replace(old, "def to_device(tree: _T, where: Where = True, *, "
                                        "donate: bool = False) -> _T:"))
    init = repo / "eqx_offload" / "__init__.py"
    init.write_text(init.read_text() + "\nfrom ._move import move as move\n")
    proc = subprocess.run(
        [sys.executable, str(repo / "scripts" / "stub_drift.py")],
        capture_output=True, text=True, cwd=repo,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "[names] FAILED" in out and "public but not in the stub: move" in out
    assert "[stubtest] FAILED" in out and "eqx_offload.to_device" in out and "donate" in out

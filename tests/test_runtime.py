"""Run-time checks: beartype names the argument and what was expected;
`install_runtime_checks` checks a user's own modules with short errors."""

import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import optax
import pytest
from beartype import beartype

import eqx_offload
from eqx_offload import Nested


PARAMS = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}


def _adam(**kwargs: Any) -> Any:
    return eqx_offload.offloaded(optax.adam(1e-3), **kwargs)


# (call, argument the error names, a word it contains, error class: beartype's for a
# value outside the annotation, else the library's own)
Check = jaxtyping.TypeCheckError
RUNTIME_MISTAKES = {
    "memory kind gpu": (lambda: eqx_offload.to_host(PARAMS, memory_kind="gpu"), "memory_kind",
                        "pinned_host", Check),
    "device memory for offloaded": (
        lambda: _adam(memory_kind="device"), "memory_kind", "unpinned_host", Check),
    # Python's own: `to_device` has no such keyword.
    "memory kind for to_device": (
        lambda: eqx_offload.to_device(PARAMS, memory_kind="device"), "memory_kind", None,
        TypeError),
    "platform name for a device": (
        lambda: eqx_offload.memory.supported_memory_kinds("cpu"), "device", "Device", Check),
    "optimizer factory": (
        lambda: eqx_offload.offloaded(optax.adam), "inner", "GradientTransformation", Check),
    "model for a transformation": (
        lambda: eqx_offload.offloaded(eqx.nn.Linear(4, 4, key=jax.random.key(0))), "inner",
        "GradientTransformation", Check),
    "transformation as its state": (
        lambda: (lambda opt: opt.update(PARAMS, opt, PARAMS))(_adam()), "state",
        "OffloadedState", eqx_offload.errors.StateError),
    "compute tpu": (lambda: _adam(compute="tpu"), "compute", "'host'", Check),
    "group_bytes string": (lambda: _adam(group_bytes="1MiB"), "group_bytes", "int", Check),
    # (`Where` resolves at run time: a forward reference would make it `Any`.)
    "string where": (lambda: eqx_offload.to_host(PARAMS, where=".*/w"), "where", "Callable", Check),
    "int where": (lambda: eqx_offload.to_device(PARAMS, where=1024), "where", "Callable", Check),
    "min_bytes string": (lambda: eqx_offload.min_bytes("1MiB"), "nbytes", "int", Check),
    "pattern int": (lambda: eqx_offload.pattern(0), "regex", "str", Check),
    # Deeper than the runtime check looks into a `Where`: the library's check.
    "string in a where prefix": (
        lambda: eqx_offload.to_host(PARAMS, where={"w": True, "b": "yes"}), "where", "filter",
        eqx_offload.errors.WhereError),
    "donate mode": (
        lambda: eqx_offload.filter_jit(lambda x: x, donate="everything"), "donate",
        "all-except-first", Check),
    "donate bool": (
        lambda: eqx_offload.filter_jit(donate=True), "donate", "all-except-first", Check),
}


@pytest.mark.parametrize("name", sorted(RUNTIME_MISTAKES))
def test_runtime_mistake_names_argument_and_expectation(name: str) -> None:
    call, argument, expected, error = RUNTIME_MISTAKES[name]
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, type(info.value)
    assert argument in str(info.value) and (expected or "") in str(info.value)


@jaxtyping.jaxtyped(typechecker=beartype)
def _moments(value: Any) -> Nested[jax.Array]:
    out: Nested[jax.Array] = value
    return out


@jaxtyping.jaxtyped(typechecker=beartype)
def _select(tree: Any, where: eqx_offload.types.Where) -> Any:
    return eqx_offload.to_host(tree, where)


def test_beartype_checks_nested_in_user_code() -> None:
    """Under the hook a user's `Nested` annotation resolves and checks two levels."""
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
    """An eager `to_host` and a compiled step define (so decorate) no function per call."""
    import jaxtyping._decorator as decorator

    opt = _adam()
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


USER_MODULE = '''
import jax.numpy as jnp
from jaxtyping import Array, Float


def predict(w: Float[Array, "d 1"], x: Float[Array, "n d"]) -> Float[Array, "n 1"]:
    return x @ w


def loss(w: Float[Array, "d 1"], x: Float[Array, "n d"], y: Float[Array, "n 1"]) -> Float[Array, ""]:
    return jnp.mean((predict(w, x) - y) ** 2)


def wrong_result(x: Float[Array, "n d"]) -> Float[Array, "n"]:
    return x
'''

ENTRY_POINT = '''
import sys
import traceback

import jax.numpy as jnp
import optax

import eqx_offload

eqx_offload.install_runtime_checks("my_training")
import my_training.model as model

w, x = jnp.ones((3, 1)), jnp.ones((8, 3))
print("correct call:", float(model.loss(w, x, jnp.ones((8, 1)))))
calls = {
    "shape": lambda: model.loss(w, x, jnp.ones((8, 3))),
    "result": lambda: model.wrong_result(x),
    "factory": lambda: eqx_offload.offloaded(optax.adam),
    "where": lambda: eqx_offload.to_host({"w": w}, where=".*/w"),
    "memory_kind": lambda: eqx_offload.to_host({"w": w}, memory_kind="gpu"),
    "pattern": lambda: eqx_offload.pattern(0),
}
# Every case in this one process, each error as Python prints it, after a marker line.
for case in sys.argv[1:]:
    try:
        calls[case]()
    except Exception as error:
        sys.stderr.write(f"@@case {case}@@\\n" + "".join(traceback.format_exception(error)))
    else:
        print(f"@@case {case}@@ no error", flush=True)
'''

# case -> what the error contains (the user's functions: jaxtyping's own message)
SHORT_ERRORS = {
    "shape": ["my_training.model.loss", "parameter 'y'", "f32[8,3]", "'n 1'", "n=8"],
    "result": ["return value of my_training.model.wrong_result", "'n'"],
    "factory": [".offloaded", "parameter 'inner'", "GradientTransformation"],
    "where": [".to_host", "parameter 'where'", "'.*/w'"],
    "memory_kind": [".to_host", "parameter 'memory_kind'", "'gpu'", "pinned_host"],
    "pattern": [".pattern", "parameter 'regex'", "0"],
}
USERS = {"shape", "result"}


@pytest.fixture(scope="module")
def user_project(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    project = tmp_path_factory.mktemp("user")
    (project / "my_training").mkdir()
    (project / "my_training" / "__init__.py").write_text("")
    (project / "my_training" / "model.py").write_text(USER_MODULE)
    (project / "train.py").write_text(ENTRY_POINT)
    return project


@pytest.fixture(scope="module")
def user_errors(user_project: pathlib.Path) -> dict[str, str]:
    """`{case: its printed error}`, from one fresh interpreter without pytest's hook."""
    proc = subprocess.run([sys.executable, "train.py", *sorted(SHORT_ERRORS)],
                          capture_output=True, text=True, cwd=user_project, timeout=300,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "correct call: 4.0" in proc.stdout  # the checked module runs correct code
    assert "no error" not in proc.stdout, proc.stdout  # every case raised
    parts = re.split(r"^@@case (\w+)@@\n", proc.stderr, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.parametrize("case", sorted(SHORT_ERRORS))
def test_install_runtime_checks_errors(user_errors: dict[str, str], case: str) -> None:
    stderr = user_errors[case]
    message = stderr[stderr.rindex("jaxtyping.TypeCheckError: "):]
    for needle in SHORT_ERRORS[case]:
        assert needle in message, f"{needle!r} not in:\n{message}"
    if case not in USERS:
        # jaxtyping's first four lines (cut to 160 characters) and a pointer to the rest.
        assert len(message.strip().splitlines()) <= 5, message
        assert "Called with parameters" not in message and "full_message" in message


def test_install_runtime_checks_refuses_imported_modules(user_project: pathlib.Path) -> None:
    script = "import my_training.model, eqx_offload\n" \
             "eqx_offload.install_runtime_checks('my_training')"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=user_project, timeout=300)
    assert proc.returncode == 1
    assert ("OptionError: install_runtime_checks: my_training, my_training.model is already "
            "imported") in proc.stderr


def test_checked_keeps_errors_of_inner_calls() -> None:
    """A wrong argument to a checked call inside another: the error names the inner one."""
    from eqx_offload._runtime import checked

    @checked
    def inner(x: int) -> int:
        return x

    @checked
    def outer(x: str) -> int:
        return inner(x)  # type: ignore[arg-type]  # the mistake under test

    with pytest.raises(jaxtyping.TypeCheckError) as info:
        outer("a")
    first = str(info.value).splitlines()[0]
    assert first.endswith(".test_checked_keeps_errors_of_inner_calls.<locals>.inner."), first
    assert "Type-check error" in info.value.full_message  # type: ignore[attr-defined]  # set by checked
    assert outer.__name__ == "outer" and inner(3) == 3

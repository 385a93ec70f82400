"""Bad input raises a documented error naming the argument, the leaf path and the fix
(`unchecked(f)`: the library's own checks, past beartype's)."""

import pathlib
import re
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import unchecked

import eqx_offload
from eqx_offload.errors import (CompositionError, MemoryKindError, NotATransformationError,
                                StateError, TracedMoveError, WhereError)


def params() -> dict[str, jax.Array]:
    return {"w": jnp.arange(6.0).reshape(2, 3) / 7 + 0.5, "b": jnp.arange(3.0) / 5 - 0.2}


@pytest.mark.parametrize("error,base", [
    (MemoryKindError, ValueError), (WhereError, ValueError), (TracedMoveError, ValueError),
    (CompositionError, ValueError), (eqx_offload.errors.CheckpointError, ValueError),
    (StateError, TypeError), (NotATransformationError, TypeError)])
def test_error_types_are_builtin_subclasses(error: type, base: type) -> None:
    assert issubclass(error, base) and issubclass(error, eqx_offload.OffloadError)


def _adam(**kwargs: Any) -> Any:
    return eqx_offload.offloaded(optax.adam(1e-3), **kwargs)


def _sgd_state() -> Any:
    return eqx_offload.offloaded(optax.sgd(1e-3, momentum=0.9)).init(params())


_TRANSPOSED = {"w": jnp.ones((3, 2)), "b": jnp.ones(3)}
_FACTORY_FIX = r"call it first \(`optax\.adamw\(1e-3\)`\)"
_NOT_A_KIND = ["memory_kind='hbm' is not a memory kind", "'device', 'pinned_host', 'unpinned_host'"]
# mistake -> (call, error, regexes its message must match: the argument, path and fix)
RAISES: dict[str, tuple[Callable[[], Any], type, list[str]]] = {
    "to_host(memory_kind='hbm')": (
        lambda: unchecked(eqx_offload.to_host)(params(), memory_kind="hbm"), MemoryKindError,
        _NOT_A_KIND),
    "offloaded(memory_kind='hbm')": (
        lambda: unchecked(eqx_offload.offloaded)(optax.adam(1e-3), memory_kind="hbm"),
        MemoryKindError, _NOT_A_KIND),
    # `device` is a memory kind, but not one state can be offloaded to.
    "to_host(memory_kind='device')": (
        lambda: unchecked(eqx_offload.to_host)(params(), memory_kind="device"), MemoryKindError,
        ["'device' is not a host memory kind.*to_device"]),
    "offloaded(memory_kind='device')": (
        lambda: unchecked(eqx_offload.offloaded)(optax.adam(1e-3), memory_kind="device"),
        MemoryKindError, ["'device' is not a host memory kind.*to_device"]),
    "unpinned_host under jit": (
        lambda: jax.jit(lambda t: eqx_offload.to_host(t, memory_kind="unpinned_host"))(params()),
        TracedMoveError, ["memory_kind='unpinned_host'.*leaf b.*memory_kind='pinned_host'"]),
    "where of another structure": (
        lambda: eqx_offload.to_host(params(), where={"w": True}), WhereError,
        ["^where ", r"keys \['w'\]", r"keys \['b', 'w'\]", "eqx_offload.pattern"]),
    "offloaded where of another structure": (
        lambda: _adam(where=(True, True, True)).init(params()), WhereError, ["at path <root>"]),
    "where deep mismatch": (
        lambda: eqx_offload.to_host({"layer": {"w": jnp.ones(3), "b": jnp.ones(3)},
                                     "head": jnp.ones(2)},
                                    where={"layer": {"w": True}, "head": True}),
        WhereError, ["at path layer"]),
    # The hints reject a string leaf of `where`; without them the library's check does.
    "where leaf not a filter under the hook": (
        lambda: eqx_offload.to_host(params(), where={"w": "yes", "b": True}),  # type: ignore[dict-item]  # the mistake under test
        TypeError, []),
    "where leaf not a filter": (
        lambda: eqx_offload._core.where.leaf_mask(params(), {"w": "yes", "b": True}), WhereError,
        ["where has 'yes' at path w, which is not a filter"]),
    "bad pattern": (lambda: eqx_offload.pattern("(mu"), WhereError,
                    [r"pattern\(regex='\(mu'\) is not a valid regular expression"]),
    "offloaded(optax.adamw)": (
        lambda: unchecked(eqx_offload.offloaded)(optax.adamw), NotATransformationError,
        [r"offloaded\(inner=\.\.\.\)", "optax.GradientTransformation", _FACTORY_FIX]),
    "offloaded(dict)": (lambda: unchecked(eqx_offload.offloaded)({"init": None}),
                        NotATransformationError, ["got builtins.dict"]),
    # Every function that takes an inner optimizer gives `offloaded`'s error, naming itself.
    "within_budget(optax.adam)": (
        lambda: unchecked(eqx_offload.stream.within_budget)(optax.adam, {"w": jnp.ones((4, 4))}, 0),
        NotATransformationError, [r"within_budget\(inner=\.\.\.\)", _FACTORY_FIX]),
    "stream_plan(optax.adam)": (
        lambda: unchecked(eqx_offload.stream.stream_plan)(optax.adam, {"w": jnp.ones((4, 4))}, None),
        NotATransformationError, [r"stream_plan\(inner=\.\.\.\)", _FACTORY_FIX]),
    "abstract_init(optax.adam)": (
        lambda: unchecked(eqx_offload.checkpoint.abstract_init)(optax.adam, {"w": jnp.ones((4, 4))}),
        NotATransformationError, [r"abstract_init\(optimizer=\.\.\.\)", _FACTORY_FIX]),
    "state of the unwrapped optimizer": (
        lambda: unchecked(_adam().update)(params(), optax.adam(1e-3).init(params()), params()),
        StateError, [r"update\(state=\.\.\.\)", "got tuple",
                     "Call `init` on the `offloaded\\(\\.\\.\\.\\)` transformation"]),
    "state of another optimizer": (
        lambda: _adam().update(params(), _sgd_state(), params()),
        StateError, [r"state=\.\.\.\)", "does not belong to this optimizer", "at path inner_state/",
                     "Pass the state returned by this transformation's `init`"]),
    "state for other params": (
        lambda: _adam().update(params(), _adam().init(_TRANSPOSED), params()),
        StateError, [r"leaf inner_state/0/mu/w is float32\[3, 2\] but this optimizer expects "
                     r"float32\[2, 3\]"]),
}


@pytest.mark.parametrize("mistake", list(RAISES))
def test_mistake_raises_naming_argument_and_fix(mistake: str) -> None:
    call, error, patterns = RAISES[mistake]
    with pytest.raises(error) as info:
        call()
    for pattern in patterns:
        assert re.search(pattern, str(info.value)), (pattern, str(info.value))


def test_kind_the_backend_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a backend without `unpinned_host` (some GPUs, TPUs) the error names what it offers."""
    monkeypatch.setattr("eqx_offload._core.memory.device_memory_kinds",
                        lambda device: ("device", "pinned_host"))
    with pytest.raises(MemoryKindError) as info:
        eqx_offload.to_host(params(), memory_kind="unpinned_host")
    message = str(info.value)
    assert "memory_kind='unpinned_host'" in message
    assert "leaf b " in message  # the first leaf it would have moved
    assert "it offers 'device', 'pinned_host'" in message and "supported_memory_kinds" in message
    opt = _adam(memory_kind="unpinned_host")
    with pytest.raises(MemoryKindError, match=r"leaf 0/mu/b .*it offers 'device', 'pinned_host'"):
        opt.init(params())


def test_multi_steps_is_accepted() -> None:
    """A `MultiSteps` is not a GradientTransformation but has one: accepted."""
    eqx_offload.offloaded(optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2))  # type: ignore[arg-type]  # MultiSteps is converted


def _offloaded_step(jit: Callable[..., Any]) -> Callable[[], Any]:
    """An offloaded Adam step jitted by `jit`, lowered only (a missed check cannot abort)."""
    opt = _adam()
    p = params()
    state = opt.init(p)

    def step(p: Any, state: Any) -> Any:
        updates, state = opt.update(p, state, p)
        return optax.apply_updates(p, updates), state

    return lambda: jit(step).lower(p, state)


def _init_with(where: Any) -> Callable[[], Any]:
    return lambda: _adam(where=where).init(params())


_MISTAKES: dict[str, tuple[Callable[[], Any], type, str]] = {
    # A plain donating jit around an offloaded step (XLA would abort the process).
    "eqx.filter_jit(donate='all')": (
        _offloaded_step(lambda f: eqx.filter_jit(f, donate="all")),
        eqx_offload.errors.CompositionError, "eqx_offload.filter_jit(step"),
    # A name where `pattern` matches whole paths: selects nothing.
    "offloaded(where=pattern('mu'))": (
        _init_with(eqx_offload.pattern("mu")), eqx_offload.errors.OffloadWarning, 'pattern(".*mu.*")'),
    "to_host(where=pattern('w'))": (
        lambda: eqx_offload.to_host([params()], where=eqx_offload.pattern("w")),
        eqx_offload.errors.OffloadWarning, 'pattern(".*w.*")'),
    # A callable of (path, leaf).
    "where=lambda path, leaf": (
        _init_with(lambda path, leaf: True), eqx_offload.errors.WhereError, "lambda x:"),
    "to_host(where=lambda path, leaf)": (
        lambda: eqx_offload.to_host(params(), where=lambda path, leaf: True),
        eqx_offload.errors.WhereError, "eqx_offload.pattern("),
    # A dtype as a filter, eagerly and under jit.
    "where=jnp.float32": (
        _init_with(jnp.float32), eqx_offload.errors.WhereError, "lambda x: x.dtype == jnp.float32"),
    "where=jnp.float32 under jit": (
        lambda: eqx_offload.filter_jit(lambda p: eqx_offload.to_host(p, where=jnp.float32))(
            params()), eqx_offload.errors.WhereError, "x.dtype == jnp.float32"),
    # A callable that returns an array (a tracer under jit) instead of a bool.
    "where returns an array": (
        lambda: eqx_offload.filter_jit(lambda p: eqx_offload.to_host(
            p, where=lambda x: x > 0))(params()), eqx_offload.errors.WhereError, "Python bool"),
    # A callable of no argument: what a `where` callable takes, not "more than one".
    "where=lambda: True": (
        _init_with(lambda: True), eqx_offload.errors.WhereError, "a callable of one argument, the leaf"),
    # Arithmetic on a host-resident leaf in the step: alone (the host-compute check), with
    # a device array (JAX's "memory_space of all inputs ... must be the same").
    "host leaf * 2 in a step": (
        lambda: eqx_offload.filter_jit(lambda s: s.inner_state[0].mu["w"] * 2)(_adam().init(params())),
        eqx_offload.errors.CompositionError, "eqx_offload.to_device("),
    "host leaf + device array in a step": (
        lambda: eqx_offload.filter_jit(lambda s, p: s.inner_state[0].mu["w"] + p["w"])(
            _adam().init(params()), params()),
        eqx_offload.errors.CompositionError, "eqx_offload.to_device("),
    # An array a donating call consumed, passed again, and to `init`.
    "a donated array passed again": (
        lambda: _twice(lambda f, p: f(p)), eqx_offload.errors.DonationError, "Pass the value the donating call returned"),
    "offloaded(...).init on donated params": (
        lambda: _twice(lambda f, p: _adam().init(p)), eqx_offload.errors.DonationError,
        "Pass the value the donating call returned"),
    "offloaded(optax.adamw)": (
        lambda: unchecked(eqx_offload.offloaded)(optax.adamw), NotATransformationError, "call it first"),
    # Nothing to move.
    "to_host([1, 2, 3])": (
        lambda: eqx_offload.to_host([1, 2, 3]), eqx_offload.errors.OffloadWarning, "jnp.asarray"),
    "to_host(3.0)": (lambda: eqx_offload.to_host(3.0), eqx_offload.errors.OffloadWarning, "jnp.asarray"),
    "to_device(3.0)": (
        lambda: eqx_offload.to_device(3.0), eqx_offload.errors.OffloadWarning, "jax.device_put"),
}


def _twice(second: Callable[[Any, Any], Any]) -> Any:
    """`second(f, p)` after `f = filter_jit(..., donate="all")` consumed `p`."""
    f = eqx_offload.filter_jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate="all")
    p = params()
    f(p)
    return second(f, p)


def _check_message(text: str, fix: str) -> None:
    """At most 4 lines and 80 words; the fix first; a link to a docs section that exists last."""
    lines = text.strip().splitlines()
    assert len(lines) <= 4 and len(text.split()) <= 80, text
    assert fix in lines[0], text
    page_url = eqx_offload._core.errors.docs_link("errors.md")
    assert page_url == "https://eqx-offload.readthedocs.io/en/latest/errors/"
    anchor = lines[-1].removeprefix(f"See {page_url}#").removesuffix(".")
    assert anchor != lines[-1], text
    page = (pathlib.Path(__file__).parents[2] / eqx_offload._core.errors.DOCS).read_text()
    assert "{#" + anchor + "}" in page, anchor


@pytest.mark.parametrize("mistake", list(_MISTAKES))
def test_newcomer_mistakes(mistake: str) -> None:
    """An `OffloadError` (or `OffloadWarning`), never a bare `TypeError`: fix, where, docs."""
    call, kind, fix = _MISTAKES[mistake]
    if issubclass(kind, Warning):
        with pytest.warns(kind) as record:
            call()
        [warning] = [w for w in record if issubclass(w.category, kind)]
        message = str(warning.message)
    else:
        with pytest.raises(kind) as info:
            call()
        assert isinstance(info.value, eqx_offload.OffloadError)
        message = str(info.value)
    _check_message(message, fix)


def test_pmap_message() -> None:
    """(Raised under `pmap`, which the multi-device tests run; its shape here.)"""
    from eqx_offload._core.errors import device_state_error

    _check_message(str(device_state_error("0/mu/w")), "eqx_offload.filter_jit")


def test_defaults_that_select_nothing_do_not_warn() -> None:
    """Default `where` on scalars only, `where=False`, a size filter, empty trees: no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqx_offload.offloaded(optax.scale_by_schedule(lambda n: 1.0)).init(params())
        eqx_offload.to_host(params(), where=False)
        eqx_offload.to_host(params(), where=eqx_offload.min_bytes(1 << 20))
        eqx_offload.to_host({}, where=eqx_offload.pattern("mu"))
        eqx_offload.to_host(None)


def test_messages_name_the_argument_and_leaf() -> None:
    """The second line says where: the function, the argument, the leaf path or source line."""
    messages = {}
    for mistake in ("where=lambda: True", "host leaf * 2 in a step",
                    "host leaf + device array in a step", "offloaded(...).init on donated params"):
        call, kind, _ = _MISTAKES[mistake]
        with pytest.raises(kind) as info:
            call()
        messages[mistake] = str(info.value).splitlines()[1]
    assert messages["where=lambda: True"].endswith("takes no argument.")
    assert "more than one" not in messages["where=lambda: True"]
    assert re.match(r"filter_jit\(<lambda>.*\): `mul` on float32<host>\[2,3\] \(at .*test_errors\.py:\d+ ",
                    messages["host leaf * 2 in a step"])
    assert re.match(r"filter_jit\(<lambda>.*\): `add` on float32<host>\[2,3\] with float32\[2,3\] "
                    r"\(at .*test_errors\.py:\d+ ", messages["host leaf + device array in a step"])
    init = messages["offloaded(...).init on donated params"]
    assert init.startswith("offloaded(...).init: params, leaf ['b'] (float32[3])"), init
    assert "functools.partial" not in init


def test_memory_space_error_keeps_jax_error_as_its_cause() -> None:
    call, _, _ = _MISTAKES["host leaf + device array in a step"]
    with pytest.raises(CompositionError) as info:
        call()
    assert type(info.value.__cause__) is ValueError
    assert "memory_space of all inputs" in str(info.value.__cause__)


def test_errors_page_lists_every_exported_exception_with_its_bases() -> None:
    """docs/errors.md's table: one row per exception of `eqx_offload.errors`, its real bases."""
    page = (pathlib.Path(__file__).parents[2] / "docs" / "errors.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", page, flags=re.M))
    exported = {name: getattr(eqx_offload.errors, name) for name in eqx_offload.errors.__all__}
    errors = {name: cls for name, cls in exported.items()
              if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, Warning)}
    assert len(errors) >= 13 and set(rows) == set(errors), set(rows) ^ set(errors)
    for name, cls in errors.items():
        assert rows[name].strip() == ", ".join(f"`{b.__name__}`" for b in cls.__bases__), name

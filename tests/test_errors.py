"""Bad input and faults: each raises a documented exception of `eqx_offload` (a subclass
of `ValueError` or `TypeError`) whose message names the argument, the leaf path where
there is one, and the fix; a failed call leaves donated inputs intact.

Under the pytest jaxtyping/beartype hook (pyproject's `--jaxtyping-packages`), a value
the type hints forbid (e.g. `memory_kind="hbm"`, which is not in the `Literal`) is
rejected by beartype before the library's own check runs. Users without the hook reach
the library's checks; `unchecked(f)` calls `f` without the hook's wrapper to test those.
"""

import pathlib
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import jaxtyping
import numpy as np
import optax
import pytest
from helpers import tree_bits as bits, unchecked

import eqx_offload


def params() -> dict[str, jax.Array]:
    return {"w": jnp.arange(6.0).reshape(2, 3) / 7 + 0.5, "b": jnp.arange(3.0) / 5 - 0.2}


def kinds(tree: Any) -> dict[str, str]:
    return {jtu.keystr(p): x.sharding.memory_kind for p, x in jtu.tree_flatten_with_path(tree)[0]}


def lacks_unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the backend offers no `unpinned_host` (as some GPUs and TPUs)."""
    monkeypatch.setattr("eqx_offload._memory.device_memory_kinds", lambda device: ("device", "pinned_host"))


# ---------------------------------------------------------------------------------------
# Memory kinds.


def test_error_types_are_builtin_subclasses() -> None:
    for error, base in [
        (eqx_offload.MemoryKindError, ValueError),
        (eqx_offload.WhereError, ValueError),
        (eqx_offload.TracedMoveError, ValueError),
        (eqx_offload.CompositionError, ValueError),
        (eqx_offload.CheckpointError, ValueError),
        (eqx_offload.StateError, TypeError),
        (eqx_offload.NotATransformationError, TypeError),
    ]:
        assert issubclass(error, base) and issubclass(error, eqx_offload.OffloadError)


@pytest.mark.parametrize("call", [
    lambda kind: unchecked(eqx_offload.to_host)(params(), memory_kind=kind),
    lambda kind: unchecked(eqx_offload.offloaded)(optax.adam(1e-3), memory_kind=kind),
])
def test_unknown_memory_kind(call: Callable[[str], Any]) -> None:
    with pytest.raises(eqx_offload.MemoryKindError) as info:
        call("hbm")
    message = str(info.value)
    assert "memory_kind='hbm' is not a memory kind" in message
    assert "'device', 'pinned_host', 'unpinned_host'" in message  # the fix: what to pass
    # `device` is a memory kind, but not one state can be offloaded to.
    with pytest.raises(eqx_offload.MemoryKindError, match="'device' is not a host memory kind.*to_device"):
        call("device")


def test_unknown_memory_kind_is_a_type_error_under_the_hook() -> None:
    # With the hook, beartype rejects it first; either way it is an error at the call.
    with pytest.raises(jaxtyping.TypeCheckError, match="memory_kind"):
        eqx_offload.to_host(params(), memory_kind="hbm")  # type: ignore[arg-type]  # the point of the test


def test_kind_the_backend_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    lacks_unpinned(monkeypatch)
    with pytest.raises(eqx_offload.MemoryKindError) as info:
        eqx_offload.to_host(params(), memory_kind="unpinned_host")
    message = str(info.value)
    assert "memory_kind='unpinned_host'" in message
    assert "leaf b " in message  # the first leaf it would have moved
    assert "it offers 'device', 'pinned_host'" in message and "supported_memory_kinds" in message
    opt = eqx_offload.offloaded(optax.adam(1e-3), memory_kind="unpinned_host")
    with pytest.raises(eqx_offload.MemoryKindError, match=r"leaf 0/mu/b .*it offers 'device', 'pinned_host'"):
        opt.init(params())


def test_unpinned_host_under_jit() -> None:
    with pytest.raises(eqx_offload.TracedMoveError, match="memory_kind='unpinned_host'.*leaf b.*memory_kind='pinned_host'"):
        jax.jit(lambda t: eqx_offload.to_host(t, memory_kind="unpinned_host"))(params())


# ---------------------------------------------------------------------------------------
# `where`.


def test_where_structure_mismatch() -> None:
    with pytest.raises(eqx_offload.WhereError) as info:
        eqx_offload.to_host(params(), where={"w": True})
    message = str(info.value)
    assert message.startswith("where ")
    assert "keys ['w']" in message and "keys ['b', 'w']" in message
    assert "eqx_offload.pattern" in message  # the fix
    # The same spec on offloaded is checked against the inner state when it is made.
    opt = eqx_offload.offloaded(optax.adam(1e-3), where=(True, True, True))
    with pytest.raises(eqx_offload.WhereError, match="at path <root>"):
        opt.init(params())


def test_where_deep_mismatch_names_the_path() -> None:
    tree = {"layer": {"w": jnp.ones(3), "b": jnp.ones(3)}, "head": jnp.ones(2)}
    with pytest.raises(eqx_offload.WhereError, match="at path layer"):
        eqx_offload.to_host(tree, where={"layer": {"w": True}, "head": True})


def test_where_not_a_filter() -> None:
    # Under the hook, the type hints of `where` already reject a string leaf; without a
    # runtime checker the spec reaches the library's own check (here called directly).
    with pytest.raises(TypeError):
        eqx_offload.to_host(params(), where={"w": "yes", "b": True})  # type: ignore[dict-item]  # the point of the test
    from eqx_offload._where import leaf_mask

    with pytest.raises(eqx_offload.WhereError, match=r"where has 'yes' at path w, which is not a filter"):
        leaf_mask(params(), {"w": "yes", "b": True})


def test_bad_pattern() -> None:
    with pytest.raises(eqx_offload.WhereError, match=r"pattern\(regex='\(mu'\) is not a valid regular expression"):
        eqx_offload.pattern("(mu")


# ---------------------------------------------------------------------------------------
# `offloaded`.


def test_not_a_gradient_transformation() -> None:
    with pytest.raises(eqx_offload.NotATransformationError) as info:
        unchecked(eqx_offload.offloaded)(optax.adamw)
    message = str(info.value)
    assert "offloaded(inner=...)" in message and "optax.GradientTransformation" in message
    assert "call it first (`optax.adamw(1e-3)`)" in message  # the fix
    with pytest.raises(eqx_offload.NotATransformationError, match="got builtins.dict"):
        unchecked(eqx_offload.offloaded)({"init": None})
    # A `MultiSteps`, which is not a GradientTransformation but has one, is accepted.
    eqx_offload.offloaded(optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2))  # type: ignore[arg-type]  # MultiSteps is converted


@pytest.mark.parametrize("call", ["within_budget", "stream_plan", "abstract_init"])
def test_not_a_gradient_transformation_elsewhere(call: str) -> None:
    # Every function that takes an inner optimizer gives `offloaded`'s error for a
    # factory, naming itself.
    params = {"w": jnp.ones((4, 4))}
    calls = {
        "within_budget": lambda: unchecked(eqx_offload.within_budget)(optax.adam, params, 0),
        "stream_plan": lambda: unchecked(eqx_offload.stream_plan)(optax.adam, params, None),
        "abstract_init": lambda: unchecked(eqx_offload.abstract_init)(optax.adam, params),
    }
    name = {"abstract_init": "abstract_init(optimizer=...)"}.get(call, f"{call}(inner=...)")
    with pytest.raises(eqx_offload.NotATransformationError) as info:
        calls[call]()
    assert name in str(info.value) and "call it first (`optax.adamw(1e-3)`)" in str(info.value)


def test_state_of_the_unwrapped_optimizer() -> None:
    opt = eqx_offload.offloaded(optax.adam(1e-3))
    plain_state = optax.adam(1e-3).init(params())
    with pytest.raises(eqx_offload.StateError) as info:
        unchecked(opt.update)(params(), plain_state, params())
    message = str(info.value)
    assert "update(state=...)" in message and "got tuple" in message
    assert "Call `init` on the `offloaded(...)` transformation" in message  # the fix


def test_state_of_another_optimizer() -> None:
    adam = eqx_offload.offloaded(optax.adam(1e-3))
    sgd = eqx_offload.offloaded(optax.sgd(1e-3, momentum=0.9))
    with pytest.raises(eqx_offload.StateError) as info:
        adam.update(params(), sgd.init(params()), params())
    message = str(info.value)
    assert "state=...)" in message and "does not belong to this optimizer" in message
    assert "at path inner_state/" in message
    assert "Pass the state returned by this transformation's `init`" in message


def test_state_for_other_params() -> None:
    opt = eqx_offload.offloaded(optax.adam(1e-3))
    other = {"w": jnp.ones((3, 2)), "b": jnp.ones(3)}
    with pytest.raises(eqx_offload.StateError, match=r"leaf inner_state/0/mu/w is float32\[3, 2\] but this optimizer expects float32\[2, 3\]"):
        opt.update(params(), opt.init(other), params())


def test_state_from_another_where_is_used_with_a_warning() -> None:
    """A state made with another `where` has the same structure; its leaves in device
    memory that this `where` selects are used as they are (with the one-time warning
    below), and the new state follows this transformation's `where`."""
    keep_nu = eqx_offload.offloaded(optax.adam(1e-3), where=eqx_offload.pattern(".*/mu/.*"))
    every = eqx_offload.offloaded(optax.adam(1e-3))
    state = keep_nu.init(params())
    assert kinds(state)[".inner_state[0].nu['w']"] == "device"
    with pytest.warns(eqx_offload.OffloadWarning, match=r"inner_state/0/nu/b is in device memory"):
        _, new = every.update(params(), state, params())
    assert kinds(new)[".inner_state[0].nu['w']"] == "pinned_host"


def test_state_on_device_warns_once_and_is_used() -> None:
    """The documented behaviour: a state that should be in host memory but is in device
    memory (e.g. restored without host shardings) is used as is, with one
    `OffloadWarning` per transformation; the result equals the unwrapped optimizer's and
    the new state is in host memory."""
    inner = optax.adam(1e-2)
    opt = eqx_offload.offloaded(inner)
    on_device = eqx_offload.to_device(opt.init(params()))
    assert set(kinds(on_device).values()) == {"device"}
    with pytest.warns(eqx_offload.OffloadWarning) as record:
        updates, state = opt.update(params(), on_device, params())
    assert len(record) == 1
    message = str(record[0].message)
    assert "state leaf inner_state/0/mu/b is in device memory" in message
    assert "eqx_offload.host_shardings" in message  # the fix
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second call does not warn
        updates2, state2 = opt.update(params(), eqx_offload.to_device(state), params())
    ref_updates, ref_state = inner.update(params(), inner.init(params()), params())
    ref_updates2, ref_state2 = inner.update(params(), ref_state, params())
    assert bits((updates, state.inner_state)) == bits((ref_updates, ref_state))
    assert bits((updates2, state2.inner_state)) == bits((ref_updates2, ref_state2))
    assert kinds(state2)[".inner_state[0].mu['w']"] == "pinned_host"


# ---------------------------------------------------------------------------------------
# Outer transformations.


def test_update_under_vmap() -> None:
    """An ensemble of optimizer states: `vmap` over `init` and `update` works, eagerly
    and under `jit`, bitwise equal to the unwrapped optimizer, state in host memory."""
    inner = optax.adam(1e-2)
    opt = eqx_offload.offloaded(inner)
    batch = jax.tree.map(lambda x: jnp.stack([x, 2 * x, -x]), params())
    states = jax.vmap(opt.init)(batch)
    assert kinds(states)[".inner_state[0].mu['w']"] == "pinned_host"
    assert kinds(states)[".inner_state[0].count"] == "device"  # 0-d per member: not selected
    ref_states = jax.vmap(inner.init)(batch)
    for update in (jax.vmap(opt.update), jax.jit(jax.vmap(opt.update))):
        updates, new = update(batch, states, batch)
        ref_updates, ref_new = jax.vmap(inner.update)(batch, ref_states, batch)
        assert bits((updates, new.inner_state)) == bits((ref_updates, ref_new))
        assert kinds(new)[".inner_state[0].nu['b']"] == "pinned_host"


def test_update_under_grad() -> None:
    """Differentiating through `update` (meta-learning), with respect to the gradients
    and to an offloaded state leaf: equal to the unwrapped optimizer's derivatives."""
    inner = optax.adam(1e-2)
    opt = eqx_offload.offloaded(inner)
    p = params()
    _, state = opt.update(p, opt.init(p), p)
    _, ref_state = inner.update(p, inner.init(p), p)

    def loss(g: Any, mu: Any) -> jax.Array:
        s = eqx_offload.OffloadedState((state.inner_state[0]._replace(mu=mu), state.inner_state[1]))
        return sum(jnp.sum(u ** 2) for u in jax.tree.leaves(opt.update(g, s, p)[0]))

    def ref_loss(g: Any, mu: Any) -> jax.Array:
        s = (ref_state[0]._replace(mu=mu), ref_state[1])
        return sum(jnp.sum(u ** 2) for u in jax.tree.leaves(inner.update(g, s, p)[0]))

    grads = jax.tree.map(lambda x: x * 3, p)
    for transform in (lambda f: f, jax.jit):  # compared eager with eager, jitted with jitted
        d_g, d_mu = transform(jax.grad(loss, argnums=(0, 1)))(grads, state.inner_state[0].mu)
        ref_g, ref_mu = transform(jax.grad(ref_loss, argnums=(0, 1)))(grads, ref_state[0].mu)
        assert bits(d_g) == bits(ref_g)
        np.testing.assert_array_equal(np.asarray(d_mu["w"]), np.asarray(ref_mu["w"]))
        # The cotangent of a host-resident leaf is host-resident too.
        assert d_mu["w"].sharding.memory_kind == "pinned_host"


# ---------------------------------------------------------------------------------------
# Failed calls keep donated inputs.


class Model(eqx.Module):
    w: jax.Array
    b: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.w + self.b


def setup() -> tuple[Model, optax.GradientTransformation, Any]:
    model = Model(jnp.arange(6.0).reshape(3, 2) / 7, jnp.ones(2) / 3)
    opt = eqx_offload.offloaded(optax.adamw(1e-2))
    return model, opt, opt.init(eqx.filter(model, eqx.is_array))


def make_step(opt: optax.GradientTransformation, fail: list[bool]) -> Callable[..., Any]:
    @eqx_offload.filter_jit(donate="all")
    def step(model: Model, state: Any, x: jax.Array) -> tuple[Model, Any]:
        if fail and fail[0]:
            raise RuntimeError("a bug in the step function")
        grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    return step


def reference(n: int) -> tuple[Model, Any]:
    model, opt, state = setup()
    step = make_step(opt, [])
    for _ in range(n):
        model, state = step(model, state, jnp.ones((4, 3)))
    return model, state


def intact(*trees: Any) -> bool:
    return not any(x.is_deleted() for x in jtu.tree_leaves(trees))


def test_error_while_tracing_keeps_donated_inputs() -> None:
    model, opt, state = setup()
    fail = [True]
    step = make_step(opt, fail)
    with pytest.raises(RuntimeError, match="a bug in the step function"):
        step(model, state, jnp.ones((4, 3)))
    assert intact(model, state)
    fail[0] = False  # fixed: training goes on from the same model and state
    for _ in range(2):
        model, state = step(model, state, jnp.ones((4, 3)))
    assert bits((model, state)) == bits(reference(2))


def test_bad_state_keeps_donated_inputs() -> None:
    model, opt, state = setup()
    step = make_step(opt, [])
    model, state = step(model, state, jnp.ones((4, 3)))
    # A bug: the state of another optimizer.
    wrong = eqx_offload.offloaded(optax.sgd(1e-2, momentum=0.9)).init(eqx.filter(model, eqx.is_array))
    with pytest.raises(eqx_offload.StateError, match="does not belong to this optimizer"):
        step(model, wrong, jnp.ones((4, 3)))
    assert intact(model, state, wrong)
    with pytest.raises(TypeError):  # a batch of the wrong shape: fails while tracing
        step(model, state, jnp.ones((4, 5)))
    assert intact(model, state)
    model, state = step(model, state, jnp.ones((4, 3)))
    assert bits((model, state)) == bits(reference(2))


def test_stale_state_keeps_the_other_inputs() -> None:
    """Passing a state that an earlier step already consumed (donated) fails before
    anything runs: the model passed with it is not deleted."""
    model, opt, state = setup()
    step = make_step(opt, [])
    model, new_state = step(model, state, jnp.ones((4, 3)))
    assert not intact(state)
    with pytest.raises(RuntimeError, match="deleted"):
        step(model, state, jnp.ones((4, 3)))
    assert intact(model, new_state)
    model, new_state = step(model, new_state, jnp.ones((4, 3)))
    assert bits((model, new_state)) == bits(reference(2))


def test_state_whose_dtype_the_inner_optimizer_changed() -> None:
    """Regression (found by tests/test_equivalence.py): `inject_hyperparams(adam)` turns a
    bfloat16 moment into float32 after one update when the params mix dtypes. The
    unwrapped optimizer accepts its own state; `offloaded` used to reject it with a
    `StateError` on the second update."""
    p = {"a": jnp.asarray(0.25, jnp.bfloat16), "b": jnp.asarray(0.5, jnp.float32)}
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b1=0.8)
    opt = eqx_offload.offloaded(inner, where=True)
    state, ref_state = opt.init(p), inner.init(p)
    for _ in range(3):
        updates, state = opt.update(p, state, p)
        ref_updates, ref_state = inner.update(p, ref_state, p)
        assert bits((updates, state.inner_state)) == bits((ref_updates, ref_state))
    assert state.inner_state.inner_state[0].mu["a"].dtype == jnp.float32
    assert state.inner_state.inner_state[0].mu["a"].sharding.memory_kind == "pinned_host"


# --- the mistakes a newcomer makes ---------------------------------------------------------


def _offloaded_step(jit: Callable[..., Any]) -> Callable[[], Any]:
    """A training step of an offloaded Adam jitted by `jit`, lowered (traced, never run:
    were the donation check to miss, nothing would run to abort the process)."""
    opt = eqx_offload.offloaded(optax.adam(1e-3))
    p = params()
    state = opt.init(p)

    def step(p: Any, state: Any) -> Any:
        updates, state = opt.update(p, state, p)
        return optax.apply_updates(p, updates), state

    return lambda: jit(step).lower(p, state)


def _init_with(where: Any) -> Callable[[], Any]:
    return lambda: eqx_offload.offloaded(optax.adam(1e-3), where=where).init(params())


_MISTAKES: dict[str, tuple[Callable[[], Any], type, str]] = {
    # A plain donating jit around an offloaded step (XLA would abort the process).
    "eqx.filter_jit(donate='all')": (
        _offloaded_step(lambda f: eqx.filter_jit(f, donate="all")),
        eqx_offload.CompositionError, "eqx_offload.filter_jit(step"),
    # A name where `pattern` matches whole paths: selects nothing.
    "offloaded(where=pattern('mu'))": (
        _init_with(eqx_offload.pattern("mu")), eqx_offload.OffloadWarning, 'pattern(".*mu.*")'),
    "to_host(where=pattern('w'))": (
        lambda: eqx_offload.to_host([params()], where=eqx_offload.pattern("w")),
        eqx_offload.OffloadWarning, 'pattern(".*w.*")'),
    # A callable of (path, leaf).
    "where=lambda path, leaf": (
        _init_with(lambda path, leaf: True), eqx_offload.WhereError, "lambda x:"),
    "to_host(where=lambda path, leaf)": (
        lambda: eqx_offload.to_host(params(), where=lambda path, leaf: True),
        eqx_offload.WhereError, "eqx_offload.pattern("),
    # A dtype as a filter, eagerly and under jit.
    "where=jnp.float32": (
        _init_with(jnp.float32), eqx_offload.WhereError, "lambda x: x.dtype == jnp.float32"),
    "where=jnp.float32 under jit": (
        lambda: eqx_offload.filter_jit(lambda p: eqx_offload.to_host(p, where=jnp.float32))(
            params()), eqx_offload.WhereError, "x.dtype == jnp.float32"),
    # A callable that returns an array (a tracer under jit) instead of a bool.
    "where returns an array": (
        lambda: eqx_offload.filter_jit(lambda p: eqx_offload.to_host(
            p, where=lambda x: x > 0))(params()), eqx_offload.WhereError, "Python bool"),
    # Nothing to move.
    "to_host([1, 2, 3])": (lambda: eqx_offload.to_host([1, 2, 3]),
                           eqx_offload.OffloadWarning, "jnp.asarray"),
    "to_host(3.0)": (lambda: eqx_offload.to_host(3.0), eqx_offload.OffloadWarning,
                     "jnp.asarray"),
    "to_device(3.0)": (lambda: eqx_offload.to_device(3.0), eqx_offload.OffloadWarning,
                       "jax.device_put"),
}


def _check_message(text: str, fix: str) -> None:
    """At most 4 lines and 80 words; the fix in the first line; a docs link last, to a
    section that exists."""
    lines = text.strip().splitlines()
    assert len(lines) <= 4 and len(text.split()) <= 80, text
    assert fix in lines[0], text
    anchor = lines[-1].removeprefix(f"See {eqx_offload._errors.DOCS}#").removesuffix(".")
    assert anchor != lines[-1], text
    page = (pathlib.Path(__file__).parents[1] / eqx_offload._errors.DOCS).read_text()
    assert "{#" + anchor + "}" in page, anchor


@pytest.mark.parametrize("mistake", list(_MISTAKES))
def test_newcomer_mistakes(mistake: str) -> None:
    # Each mistake the issue lists gets its class (an `OffloadError`, or an
    # `OffloadWarning` where the input is valid but surely not meant), never a bare
    # `TypeError` or a tracer error from inside the package, in at most 4 lines:
    # the fix first, then where, then the docs section. (`memory_report` of an
    # abstract state counts it: tests/test_report.py.)
    call, kind, fix = _MISTAKES[mistake]
    if issubclass(kind, Warning):
        with pytest.warns(kind) as record:
            call()
        [warning] = [w for w in record if issubclass(w.category, kind)]
        _check_message(str(warning.message), fix)
    else:
        with pytest.raises(kind) as info:
            call()
        assert isinstance(info.value, eqx_offload.OffloadError)
        _check_message(str(info.value), fix)


def test_pmap_message() -> None:
    # (Raised under `pmap`, which the multi-device tests run; its shape here.)
    from eqx_offload._errors import device_state_error

    _check_message(str(device_state_error("0/mu/w")), "eqx_offload.filter_jit")


def test_defaults_that_select_nothing_do_not_warn() -> None:
    # The default `where` on a state of scalars only, `where=False`, a size filter that
    # selects nothing in a small tree, and an empty tree: meant, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqx_offload.offloaded(optax.scale_by_schedule(lambda n: 1.0)).init(params())
        eqx_offload.to_host(params(), where=False)
        eqx_offload.to_host(params(), where=eqx_offload.min_bytes(1 << 20))
        eqx_offload.to_host({}, where=eqx_offload.pattern("mu"))
        eqx_offload.to_host(None)

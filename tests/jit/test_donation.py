"""`filter_jit`'s donation: the matrix of donation modes and output orders; a failed call
(an error while tracing, a bad or stale state) leaves the donated inputs intact; a buffer
shared by several arguments is donated once (the ported DCGAN programs too)."""

import re
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import pytest
from donation_harness import mlp_setup, mlp_step, state_kinds, STEPS, unpack
from helpers import assert_tree_equal, count_compiles, hex_bits, kind_list, tree_bits as bits
from helpers import assert_same_run
from isolated import call_isolated
from ports import dcgan, dcgan_example

import eqx_offload


# The donation matrix (in a subprocess: a regression would abort the process)


MODES = ("all", "all-except-first", "warn", "warn-except-first")
DONATION_CONFIGS = [(donate, order) for donate in MODES for order in ("model_state", "state_model")]
DONATION_CONFIGS += [("state-only", "model_state"), ("state-only-warn", "model_state")]


def _unusable(messages: list[str]) -> set[str]:
    """The avals JAX lists in its "Some donated buffers were not usable" warnings."""
    found: set[str] = set()
    for message in messages:
        match = re.search(r"Some donated buffers were not usable: (.*?)\.\n", message)
        assert match is not None, message
        found.update(a.strip() for a in re.split(r",\s*(?![^\[]*\])", match.group(1)))
    return found


def _deleted(tree: Any) -> list[bool]:
    return [x.is_deleted() for x in jtu.tree_leaves(eqx.filter(tree, eqx.is_array))]


def _donating_run(donate: str, order: str) -> dict[str, Any]:
    """`STEPS` donating steps of an offloaded-adamw loop, and what happened."""
    model, opt, state, x = mlp_setup()
    if donate.startswith("state-only"):  # the state is the only argument: x is closed over
        inner = mlp_step(opt, order)
        mode = "warn-except-first" if donate.endswith("warn") else "all-except-first"
        call = eqx_offload.filter_jit(lambda m, s: inner(m, s, x), donate=mode)
    else:
        step = eqx_offload.filter_jit(mlp_step(opt, order), donate=donate)
        call = lambda m, s: step(m, s, x)  # noqa: E731
    run: dict[str, Any] = {"losses": [], "deleted_state": [], "deleted_model": []}
    with count_compiles() as compiles, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            old_model, old_state = model, state
            model, state, loss = unpack(call(model, state), order)
            run["deleted_state"].append(_deleted(old_state))
            run["deleted_model"].append(_deleted(old_model))
            run["losses"].append(hex_bits(loss))
            assert kind_list(model) == ["device"] * len(kind_list(model))
            assert kind_list(state) == state_kinds(state), kind_list(state)
    avals = {f"{x.dtype}[{','.join(map(str, x.shape))}]" for x in jtu.tree_leaves(state)}
    return {**run, "model": hex_bits(model), "state": hex_bits(state.inner_state),
            "warnings": [str(w.message) for w in caught], "compiles": len(compiles),
            "state_avals": sorted(avals)}


def donation_child() -> dict[str, Any]:
    """The reference (no offload, no donation) and every configuration, in a fresh process."""
    model, opt, state, x = mlp_setup(offload=False)
    step = eqx.filter_jit(mlp_step(opt))
    losses = []
    for _ in range(STEPS):
        model, state, loss = step(model, state, x)
        losses.append(hex_bits(loss))
    results = {f"{d}/{o}": _donating_run(d, o) for d, o in DONATION_CONFIGS}
    return {"reference": {"losses": losses, "model": hex_bits(model), "state": hex_bits(state)},
            **results}


def _donation_failures(result: dict[str, Any], reference: dict[str, Any], donate: str) -> list[str]:
    """The claims a run breaks: bit for bit the loop without offload or donation; every state
    leaf deleted after each call, the model only where the first argument is donated; no
    state leaf "not usable" (in the `warn` modes only the batch is; the others silence the
    warning); one compilation for all the steps (the first call's params are uncommitted)."""
    model_donated = donate in ("all", "warn")
    warn = donate in ("warn", "warn-except-first")
    unusable = _unusable(result["warnings"]) if warn else set()
    checks = {
        "losses differ from the reference": result["losses"] == reference["losses"],
        "params differ from the reference": result["model"] == reference["model"],
        "state differs from the reference": result["state"] == reference["state"],
        f"donated state leaves not deleted: {result['deleted_state']}":
            all(all(step) for step in result["deleted_state"]),
        f"model leaves deleted: {result['deleted_model']}, donated: {model_donated}":
            all(all(step) == any(step) == model_donated for step in result["deleted_model"]),
        f"unusable donations: {unusable}": not warn or unusable == {"float32[4,3]"},
        f"state leaves unusable: {unusable}": not set(result["state_avals"]) & unusable,
        f"warnings: {result['warnings']}": warn or result["warnings"] == [],
        f"{result['compiles']} compilations": result["compiles"] == 1,
    }
    return [what for what, ok in checks.items() if not ok]


@pytest.mark.slow
def test_donation():
    """Every donation mode and output order, in one fresh process (an abort fails it)."""
    results = call_isolated(donation_child)
    failures = {f"{d}/{o}": _donation_failures(results[f"{d}/{o}"], results["reference"], d)
                for d, o in DONATION_CONFIGS}
    assert not any(failures.values()), failures
    assert len(results) == len(DONATION_CONFIGS) + 1


def test_donation_checks_can_fail():
    reference = {"losses": ["a"], "model": ["b"], "state": ["c"]}
    good = {**reference, "deleted_state": [[True, True]], "deleted_model": [[True]],
            "warnings": [], "compiles": 1, "state_avals": ["float32[8,3]"]}
    assert _donation_failures(good, reference, "all") == []
    unusable = ("Some donated buffers were not usable: float32[8,3], float32[4,3].\n"
                "See an explanation at https://docs.jax.dev/en/latest/faq.html.")
    for bad, donate in [
        ({"losses": ["x"]}, "all"), ({"deleted_state": [[True, False]]}, "all"),
        ({"deleted_model": [[True]]}, "all-except-first"), ({"warnings": [unusable]}, "warn"),
        ({"warnings": [unusable]}, "all"), ({"compiles": 2}, "all")]:
        assert _donation_failures({**good, **bad}, reference, donate), (bad, donate)


# A failed call keeps the donated inputs


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


def intact(*trees: Any) -> bool:
    return not any(x.is_deleted() for x in jtu.tree_leaves(trees))


def test_a_failed_call_keeps_donated_inputs() -> None:
    """Each failure leaves the donated inputs intact; training goes on from them."""
    model, opt, state = setup()
    fail = [True]
    step = make_step(opt, fail)
    with pytest.raises(RuntimeError, match="a bug in the step function"):
        step(model, state, jnp.ones((4, 3)))  # an error while tracing
    assert intact(model, state)
    fail[0] = False  # fixed
    model, new_state = step(model, state, jnp.ones((4, 3)))
    assert not intact(state)
    with pytest.raises(RuntimeError, match="deleted"):  # a stale state fails before running
        step(model, state, jnp.ones((4, 3)))
    assert intact(model, new_state)
    wrong_opt = eqx_offload.offloaded(optax.sgd(1e-2, momentum=0.9))  # a bug: another's state
    wrong = wrong_opt.init(eqx.filter(model, eqx.is_array))
    with pytest.raises(eqx_offload.errors.StateError, match="does not belong to this optimizer"):
        step(model, wrong, jnp.ones((4, 3)))
    assert intact(model, new_state, wrong)
    with pytest.raises(TypeError):  # a batch of the wrong shape: fails while tracing
        step(model, new_state, jnp.ones((4, 5)))
    assert intact(model, new_state)
    model, new_state = step(model, new_state, jnp.ones((4, 3)))
    ref_model, ref_opt, ref_state = setup()
    ref_step = make_step(ref_opt, [])
    for _ in range(2):
        ref_model, ref_state = ref_step(ref_model, ref_state, jnp.ones((4, 3)))
    assert bits((model, new_state)) == bits((ref_model, ref_state))


# A buffer shared by several arguments


def test_a_shared_buffer_is_donated_once() -> None:
    def double(a: Any, b: Any) -> Any:
        return a * 2, b + 1

    x, kept = jnp.arange(4.0), jnp.arange(4.0)
    step = eqx_offload.filter_jit(double, donate="all")
    with count_compiles() as compiled:
        a, b = step(x, x)  # one buffer at two donated leaves
        assert x.is_deleted()
        c, d = step(jnp.arange(4.0), jnp.arange(4.0))  # two buffers: the same executable
    assert len(compiled) == 1
    assert_tree_equal((a, b), (c, d))
    assert_tree_equal((a, b), (jnp.arange(4.0) * 2, jnp.arange(4.0) + 1))
    # Shared with the first argument, which "all-except-first" never donates: it survives.
    a, b = eqx_offload.filter_jit(double, donate="all-except-first")(kept, kept)
    assert not kept.is_deleted()
    assert_tree_equal((a, b), (kept * 2, kept + 1))
    # A host-resident state passed twice.
    opt = eqx_offload.offloaded(optax.adam(1e-2))
    params = {"w": jnp.ones((2, 3))}
    state = opt.init(params)

    @eqx_offload.filter_jit(donate="all")
    def step(params, state, same_state):
        updates, state = opt.update(params, state, params)
        return optax.apply_updates(params, updates), state

    ref = optax.adam(1e-2)
    _, ref_state = ref.update(params, ref.init(params), params)
    _, new_state = step(params, state, state)
    assert_tree_equal(new_state.inner_state, ref_state)
    assert all(x.is_deleted() for x in jax.tree.leaves(state))


@pytest.mark.slow
@pytest.mark.parametrize("program", [dcgan, dcgan_example])
def test_dcgan_shared_buffers_donated(program: Any) -> None:
    """States sharing arrays: plain `eqx.filter_jit` cannot donate them; the port (DCGAN:
    "all"; the example: donating what it returns) is bitwise the plain run, inputs consumed."""
    with pytest.raises(Exception, match="donate the same buffer twice"):
        program.train(False, donate="all")
    deleted: list[bool] = []
    ported = program.train(True, donate="all" if program is dcgan else "returned", deleted=deleted)
    plain = program.train(False, donate="none")
    assert_same_run(plain, ported)
    assert deleted == [True] * program.STEPS
    if program is dcgan_example:
        assert ported.compiles == plain.compiles == [2] + [0] * (program.STEPS - 1)

"""`offloaded`'s update on states it did not make, under `vmap` and `grad`; and what one eager
default update costs in the package's code: its functions, files, lines and pytree walks."""

import inspect
import os
import sys
import warnings
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import memory_kinds, tree_bits as bits

import eqx_offload
from eqx_offload._core import compat


def params() -> dict[str, jax.Array]:
    return {"w": jnp.arange(6.0).reshape(2, 3) / 7 + 0.5, "b": jnp.arange(3.0) / 5 - 0.2}


def test_state_from_another_where_is_used_with_a_warning() -> None:
    """A state made with another `where` is used, with a warning; the new state follows ours."""
    every = eqx_offload.offloaded(optax.adam(1e-3))
    mu_only = eqx_offload.offloaded(optax.adam(1e-3), where=eqx_offload.pattern(".*/mu/.*"))
    state = mu_only.init(params())
    assert memory_kinds(state)["inner_state/0/nu/w"] == "device"
    with pytest.warns(eqx_offload.errors.OffloadWarning, match=r"inner_state/0/nu/b is in device memory"):
        _, new = every.update(params(), state, params())
    assert memory_kinds(new)["inner_state/0/nu/w"] == "pinned_host"


def test_state_on_device_warns_once_and_is_used() -> None:
    """Used with one warning per transformation; bitwise as unwrapped, the new state on host."""
    inner = optax.adam(1e-2)
    opt = eqx_offload.offloaded(inner)
    on_device = eqx_offload.to_device(opt.init(params()))
    assert set(memory_kinds(on_device).values()) == {"device"}
    with pytest.warns(eqx_offload.errors.OffloadWarning) as record:
        updates, state = opt.update(params(), on_device, params())
    assert len(record) == 1
    message = str(record[0].message)
    assert "state leaf inner_state/0/mu/b is in device memory" in message
    assert "eqx_offload.checkpoint.host_shardings" in message  # the fix
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second call does not warn
        updates2, state2 = opt.update(params(), eqx_offload.to_device(state), params())
    ref_updates, ref_state = inner.update(params(), inner.init(params()), params())
    ref_updates2, ref_state2 = inner.update(params(), ref_state, params())
    assert bits((updates, state.inner_state)) == bits((ref_updates, ref_state))
    assert bits((updates2, state2.inner_state)) == bits((ref_updates2, ref_state2))
    assert memory_kinds(state2)["inner_state/0/mu/w"] == "pinned_host"


def test_update_under_vmap() -> None:
    """`vmap` over `init` and `update`, eager and jitted: bitwise as unwrapped, on the host."""
    inner = optax.adam(1e-2)
    opt = eqx_offload.offloaded(inner)
    batch = jax.tree.map(lambda x: jnp.stack([x, 2 * x, -x]), params())
    states = jax.vmap(opt.init)(batch)
    assert memory_kinds(states)["inner_state/0/mu/w"] == "pinned_host"
    assert memory_kinds(states)["inner_state/0/count"] == "device"  # 0-d per member: not selected
    ref_states = jax.vmap(inner.init)(batch)
    for transform in (lambda f: f, jax.jit):  # compared eager with eager, jitted with jitted
        updates, new = transform(jax.vmap(opt.update))(batch, states, batch)
        ref_updates, ref_new = transform(jax.vmap(inner.update))(batch, ref_states, batch)
        assert bits((updates, new.inner_state)) == bits((ref_updates, ref_new))
        assert memory_kinds(new)["inner_state/0/nu/b"] == "pinned_host"


def test_update_under_grad() -> None:
    """`grad` through `update` by the gradients and an offloaded leaf: as unwrapped."""
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


@pytest.mark.parametrize("mode", [{}, {"group_bytes": None}, {"group_bytes": 8}])
def test_grad_through_two_updates(mode: dict[str, Any]) -> None:
    """`jax.grad` through two updates (the second reads the state the first stored in
    host memory), by a scale of the gradients: bitwise as unwrapped, eagerly and under
    every jit; the cotangent of the state is host-resident."""
    theta = jnp.arange(1.0, 5.0)

    def derivatives(opt: Any) -> list[Any]:
        def f(s: Any, theta: Any, state: Any) -> Any:
            for _ in range(2):
                u, state = opt.update(s * theta, state)
                theta = optax.apply_updates(theta, u)
            return jnp.sum(theta ** 2)

        state = opt.init(theta)
        grad = jax.grad(f, argnums=(0, 2))
        return [jit(grad)(1.0, theta, state) for jit in (
            lambda f: f, jax.jit, eqx_offload.jit, eqx_offload.filter_jit)]

    ported = derivatives(eqx_offload.offloaded(optax.rmsprop(0.1), **mode))
    plain = derivatives(optax.rmsprop(0.1))
    assert bits([(d, s.inner_state) for d, s in ported]) == bits(plain)
    assert float(plain[0][0]) != 0.0
    assert {memory_kinds(s)["inner_state/0/nu"] for _, s in ported} == {"pinned_host"}


@pytest.mark.parametrize("options", [{}, {"where": True}, {"where": True, "group_bytes": 8}])
def test_grad_by_a_learning_rate_written_into_the_state(options: dict[str, Any]) -> None:
    """Optax's meta-learning write: `state.hyperparams["learning_rate"] = sigmoid(eta)`,
    then two updates, differentiated by `eta`: bitwise as unwrapped, eagerly and under
    every jit (the hyperparameters on the device by default, in host memory with
    `where=True`; the whole state at once on the CPU, or streamed)."""
    theta = jnp.arange(1.0, 5.0)

    def derivatives(offload: bool) -> list[Any]:
        opt = optax.inject_hyperparams(optax.rmsprop)(learning_rate=0.1)
        if offload:
            opt = eqx_offload.offloaded(opt, **options)

        def f(eta: Any, theta: Any, state: Any) -> Any:
            state.hyperparams["learning_rate"] = jax.nn.sigmoid(eta)
            for _ in range(2):
                u, state = opt.update(theta, state)
                theta = optax.apply_updates(theta, u)
            return jnp.sum(theta ** 2)

        return [jit(jax.grad(f))(0.5, theta, opt.init(theta)) for jit in (
            lambda f: f, jax.jit, eqx_offload.jit, eqx_offload.filter_jit)]

    plain = derivatives(False)
    assert bits(derivatives(True)) == bits(plain) and float(plain[0]) != 0.0


def test_grad_through_a_host_compute_update_is_refused_clearly() -> None:
    """`compute="host"` under `jax.grad`: a `CompositionError` with the fix (JAX's own
    transpose error otherwise); its update undifferentiated under `jit` still runs."""
    opt = eqx_offload.offloaded(optax.rmsprop(0.1), compute="host")
    theta = jnp.arange(1.0, 5.0)
    state = opt.init(theta)

    def f(s: Any, state: Any) -> Any:
        u, state = opt.update(s * theta, state)
        return jnp.sum(optax.apply_updates(theta, u) ** 2)

    with pytest.raises(eqx_offload.errors.CompositionError, match="^Differentiate through "
                       r"`offloaded\(..., compute='device'\)`"):
        jax.jit(jax.grad(f))(1.0, state)
    assert jnp.isfinite(jax.jit(f)(1.0, state))


def test_state_whose_dtype_the_inner_optimizer_changed() -> None:
    """`inject_hyperparams(adam)` turns a bfloat16 moment float32 (mixed dtypes): accepted."""
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


_PACKAGE = os.path.dirname(eqx_offload.__file__) + os.sep
_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})
_TREE_MODULES = (os.path.join("jax", "_src", "tree_util.py"), os.path.join("jax", "_src", "tree.py"))
_WALKS = {prefix + name for prefix in ("tree_", "") for name in (
    "flatten", "leaves", "map", "structure", "unflatten", "flatten_with_path",
    "leaves_with_path", "map_with_path")}


def _ours(frame: Any) -> bool:
    # By the code's file: the wrappers jaxtyping's import hook adds have their own.
    return frame is not None and frame.f_code.co_filename.startswith(_PACKAGE)


def profile_update(update: Any, *args: Any) -> dict[str, Any]:
    """The package's functions `update(*args)` runs, their files and lines, its pytree walks."""
    codes: set[Any] = set()
    walks = [0]

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(_PACKAGE):
                codes.add(code)
            elif (code.co_filename.endswith(_TREE_MODULES) and code.co_name in _WALKS
                  and _ours(frame.f_back)):
                walks[0] += 1
        elif event == "c_call" and _ours(frame) and "flatten" in getattr(arg, "__name__", ""):
            walks[0] += 1  # a `PyTreeDef`/registry method called directly

    sys.setprofile(hook)
    try:
        update(*args)
    finally:
        sys.setprofile(None)
    return {"functions": sorted(f"{os.path.basename(c.co_filename)}:{c.co_name}" for c in codes),
            "files": sorted({os.path.basename(c.co_filename) for c in codes}),
            # (a comprehension's lines are its function's, counted: on Python 3.11
            # `getsourcelines` of its own code object reads on to the end of that function)
            "lines": sum(len(inspect.getsourcelines(code)[0]) for code in codes
                         if code.co_name not in _COMPREHENSIONS),
            "walks": walks[0]}


def test_eager_default_update_is_short() -> None:
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3), "e": jnp.ones((5, 2))}
    grads = {k: 0.5 * v + 0.25 for k, v in params.items()}
    opt = eqx_offload.offloaded(optax.adamw(1e-3))
    state = opt.init(params)
    _, state = opt.update(grads, state, params)  # warm-up: the layout, the first checks
    measured = profile_update(opt.update, grads, state, params)
    print(f"\n{measured['lines']} lines, {measured['walks']} walks in", *measured["functions"])
    # offloaded, checks, strategies, layout; move's `put` (and on JAX 0.12.1 compat's
    # route around its host-output copy, 44 lines)
    assert len(measured["files"]) <= 5 + compat.HOST_OUTPUT_COPY_FAILS
    assert measured["lines"] <= 260 + 50 * compat.HOST_OUTPUT_COPY_FAILS
    assert measured["walks"] <= 8


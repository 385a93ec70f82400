"""`filter_jit`'s seams: the `Signature` that keys its cache and the one analysis pass."""

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import pytest

import eqx_offload
from eqx_offload._core.compat import marked
from eqx_offload._jit.call import flatten_call, Signature
from eqx_offload._jit.donation import parse_donate
from eqx_offload._jit.stage import analyse
from eqx_offload._optim.checks import foreign_donation


def _key(*args: object) -> Signature:
    return flatten_call(args, {}, parse_donate("none", None)).key


def test_signature_is_a_frozen_hashable_key() -> None:
    """Same configuration, same key; a static value's type or a shape makes another."""
    key = _key(jnp.ones(3), 1)
    assert isinstance(key, Signature) and hash(key) == hash(_key(jnp.ones(3), 1))
    assert key == _key(jax.device_put(jnp.ones(3)), 1)  # committed or not: one executable
    assert key != _key(jnp.ones(3), 1.0)  # `1` and `1.0` do not share
    assert key != _key(jnp.ones(4), 1)
    assert key.statics == ((int, 1),) and key.is_array == (True, False)
    with pytest.raises(AttributeError):
        key.statics = ()  # type: ignore[misc]  # a NamedTuple: frozen


def test_analysis_reads_scopes_and_constraints_and_lints() -> None:
    """One pass: marked scopes, output constraints, and the host-compute error."""
    def marked_step(x: jax.Array) -> jax.Array:
        with marked("streamed"):
            y = x * 2
        return jax.lax.with_sharding_constraint(y, jax.sharding.make_single_device_sharding(
            jax.devices()[0]))

    found = analyse(jax.make_jaxpr(marked_step)(jnp.ones(3)), "marked_step")
    assert (found.streamed, found.prefetched, found.whole) == (True, False, False)
    assert found.out_constraints[0] is not None
    plain = analyse(jax.make_jaxpr(lambda x: x + 1)(jnp.ones(3)), "plain")
    assert not (plain.streamed or plain.whole) and plain.out_constraints == (None,)
    assert dataclasses.is_dataclass(plain)
    host = eqx_offload.to_host(jnp.ones(3))
    with pytest.raises(eqx_offload.errors.CompositionError, match="computes on host-resident"):
        analyse(jax.jit(lambda x: x + 1).trace(host).jaxpr, "host")


def test_foreign_donation_names_a_donating_jit_tracing_it() -> None:
    """`foreign_donation` names a donating `jax.jit` tracing it; `None` for one that
    donates nothing."""
    def found(donate: tuple[int, ...]) -> Optional[str]:
        seen: list[Optional[str]] = []

        def donating(x: jax.Array) -> jax.Array:
            seen.append(foreign_donation())
            return x

        jax.jit(donating, donate_argnums=donate).trace(jnp.ones(3))
        return seen[0]

    assert found((0,)) == found.__qualname__ + ".<locals>.donating"
    assert found(()) is None


def test_the_lint_reads_sources_only_for_the_equation_it_refuses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A clean program's equations are never described; a refused one names the line
    where it is written, inside a sub-jaxpr too."""
    from eqx_offload._jit import lint

    calls: list[object] = []
    monkeypatch.setattr(lint, "_where_in_source", _counting(lint._where_in_source, calls))
    analyse(jax.make_jaxpr(lambda x: jax.lax.cond(True, jnp.sin, jnp.cos, x) + 1)(
        jnp.ones(3)), "clean")
    assert calls == []

    def double(x: jax.Array) -> jax.Array:
        return x * 2

    line = double.__code__.co_firstlineno + 1
    host = eqx_offload.to_host(jnp.ones(3))
    with pytest.raises(eqx_offload.errors.CompositionError,
                       match=rf"test_call.py:{line} in \S*double\)"):
        analyse(jax.jit(lambda x: jax.lax.cond(True, double, double, x)).trace(host).jaxpr,
                "host")
    assert len(calls) == 1


def _counting(fun: Any, calls: list[object]) -> Any:
    def counted(eqn: object) -> Any:
        calls.append(eqn)
        return fun(eqn)
    return counted

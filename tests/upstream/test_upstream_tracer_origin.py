"""Canary: JAX's tracers keep the equation that made them (`parent`) and their
variable (`val`), and a trace maps the variables of the values it closed over to the
outer values (`_trace.frame.constvar_to_val`): private fields that
`compat.tracer_origin` reads so that `filter_jit`'s error can say whether a host
operand is an argument of the step or a value it made. If JAX drops them, the error
says less and this fails first."""

import jax
import jax.numpy as jnp

from eqx_offload._core.compat import tracer_origin


def test_arguments_made_values_and_closed_over_values_are_told_apart() -> None:
    seen = {}

    def f(x):
        y = x * 2
        seen["argument"], seen["made"] = tracer_origin(x), tracer_origin(y)

        def body(carry, _):
            out = carry + x
            frame = carry._trace.frame  # the body's trace
            seen["closed"] = [v for v in frame.constvar_to_val.values() if v is x]
            seen["carry"] = tracer_origin(carry)
            seen["body_made"] = tracer_origin(out)
            return out, None

        return jax.lax.scan(body, jnp.zeros(3), None, length=2)[0]

    jax.jit(f).trace(jnp.ones(3))
    assert seen["argument"][1] is False and seen["made"][1] is True
    assert seen["carry"][1] is False and seen["body_made"][1] is True
    assert len(seen["closed"]) == 1  # the closed-over argument, mapped out to itself

"""User mistakes with `filter_jit`, `Nested` and reports."""

import jax
import jax.numpy as jnp

import eqx_offload
from eqx_offload import Nested


def step(x: jax.Array) -> jax.Array:
    return x * 2


# A donation mode that does not exist.
eqx_offload.filter_jit(step, donate="everything")  # expect: mypy=call-overload pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# The decorator form, same mistake.
eqx_offload.filter_jit(donate=True)  # expect: mypy=call-overload pytype=wrong-arg-types pyright=reportArgumentType pyrefly=no-matching-overload

# The compiled function keeps the signature of `step`.
eqx_offload.filter_jit(step)("not an array")  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# A saved step loads from its bytes, not from the name of their file.
eqx_offload.filter_jit(step).load("step.bin")  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type


def moments() -> Nested[jax.Array]:
    # A `Nested[jax.Array]` is arrays in dicts, lists and tuples; a string is none of those.
    return "mu"  # expect: mypy=return-value pytype=bad-return-type pyright=reportReturnType pyrefly=bad-return


# `memory_report` returns a report, not a number of bytes.
host_bytes: int = eqx_offload.memory_report({"w": jnp.ones(3)})  # expect: mypy=assignment pytype=annotation-type-mismatch pyright=reportAssignmentType pyrefly=bad-assignment

# `host_bytes` is an int.
eqx_offload.memory_report({"w": jnp.ones(3)}).host_bytes + " bytes"  # expect: mypy=operator pytype=unsupported-operands pyright=reportOperatorIssue pyrefly=unsupported-operation

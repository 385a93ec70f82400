"""Canary: XLA:TPU cannot copy one row of an `(L, D)` array of a dtype under 32 bits out of
host memory (2 bf16 or 4 int8 values share a 32-bit word along the second-to-last axis),
nor write one row into one (a scan stacking a bf16 vector per layer in host memory: with
libtpu 0.0.42 a failed CHECK stops the process, with 0.0.50 the compile raises). So
`scan_layers` brings such stacked host leaves to the device whole (`_models/scan.py`,
`_fetch_packed_vectors`) and keeps such vectors on the device where it would offload
them (`_offload_input`; `_models/remat.py`, `in_a_scan`). Matrices `(L, A, B)` and fp32
vectors slice. When these tests fail, XLA copies packed rows: the workarounds may go.
(Compiled for a TPU v5e without one: `helpers.v5e`.)"""

import jax
import jax.numpy as jnp
import pytest
from helpers import tpu_plan_marks, TPU_ENV, v5e
from isolated import run_isolated
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


pytestmark = tpu_plan_marks()


def _compile_row_fetch(shape: tuple[int, ...], dtype: jnp.dtype) -> None:
    """A scan over a host array's leading axis, each row brought to the device."""
    mesh = Mesh([v5e()], ("x",))

    def f(stacked: jax.Array) -> jax.Array:
        def body(total: jax.Array, row: jax.Array) -> tuple[jax.Array, None]:
            return total + jax.device_put(row, jax.memory.Space.Device).astype(jnp.float32), None
        return jax.lax.scan(body, jnp.zeros(shape[1:], jnp.float32), stacked)[0]

    host = NamedSharding(mesh, P(), memory_kind="pinned_host")
    jax.jit(f).lower(jax.ShapeDtypeStruct(shape, dtype, sharding=host)).compile()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_tpu_cannot_fetch_one_packed_row_from_host_memory(dtype: jnp.dtype) -> None:
    with pytest.raises(Exception, match="Sublane slicing size"):
        _compile_row_fetch((8, 256), dtype)


@pytest.mark.parametrize("shape, dtype", [((8, 256), jnp.float32),
                                          ((8, 256, 256), jnp.bfloat16)])
def test_tpu_fetches_fp32_rows_and_packed_matrices(shape: tuple[int, ...],
                                                   dtype: jnp.dtype) -> None:
    _compile_row_fetch(shape, dtype)


def compile_row_store() -> None:
    """(In a child process.) A scan whose iterations each write a bf16 row into one
    host array: XLA:TPU fails to compile it (or stops the process)."""
    mesh = Mesh([v5e()], ("x",))

    def f(x: jax.Array) -> jax.Array:
        def body(h: jax.Array, _: None) -> tuple[jax.Array, jax.Array]:
            return jnp.tanh(h), jax.device_put(h, jax.memory.Space.Host)
        return jax.lax.scan(body, x, length=8)[1]

    device = NamedSharding(mesh, P(), memory_kind="device")
    jax.jit(f).lower(jax.ShapeDtypeStruct((256,), jnp.bfloat16, sharding=device)).compile()


def test_tpu_cannot_store_one_packed_row_in_host_memory() -> None:
    child = run_isolated(compile_row_store, env=TPU_ENV)
    assert child.returncode != 0
    assert "Sublane slicing size" in child.stderr

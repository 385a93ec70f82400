"""Canary: XLA:TPU cannot copy one row of an `(L, D)` array of a dtype under 32 bits out of
host memory (2 bf16 or 4 int8 values share a 32-bit word along the second-to-last axis),
so `scan_layers` brings such stacked host leaves to the device whole
(`_models/scan.py`, `_fetch_packed_vectors`). Matrices `(L, A, B)` and fp32 vectors slice.
When this test fails, XLA slices packed rows: the whole fetch may go. (Compiled for a TPU
v5e without one: `helpers.v5e`.)"""

import jax
import jax.numpy as jnp
import pytest
from helpers import v5e
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


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

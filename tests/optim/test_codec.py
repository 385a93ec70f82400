"""The 8-bit state's codec by arithmetic (`_optim/quantize.py`: `_decoded`, `_encoded`):
bitwise the table look-up and the count of midpoints it replaces, with no gather and no
pass over the map's entries on an accelerator.

The decoder's domain is the 256 codes: checked whole. The encoder's count can only
change at a midpoint, so each midpoint and the float32 on either side of it decide it;
random bit patterns and hypothesis check the rest, with the special values."""

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, HealthCheck, settings

from eqx_offload._optim import quantize as q


pytestmark = pytest.mark.both  # (how XLA rounds and fuses is the compiler's)

SIGNS = pytest.mark.parametrize("signed", [True, False])
SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, np.inf, -np.inf, np.nan, -np.nan,
                    1e-45, -1e-45, 1e-38, -1e-38, 1.1754944e-38, -1.1754944e-38,
                    3.4028235e38, -3.4028235e38], np.float32)


def _decode(codes: np.ndarray, signed: bool) -> np.ndarray:
    return np.asarray(jax.jit(q._decoded, static_argnums=1)(jnp.asarray(codes), signed))


def _encode(x: np.ndarray, signed: bool) -> np.ndarray:
    return np.asarray(jax.jit(q._encoded, static_argnums=1)(jnp.asarray(x), signed))


def _count(x: np.ndarray, signed: bool) -> np.ndarray:
    """How many midpoints each value reaches (a NaN none), in NumPy."""
    found = np.searchsorted(q.midpoints(signed), x, side="right")
    return np.where(np.isnan(x), 0, found)


@SIGNS
def test_decoding_is_the_map_for_every_code(signed: bool) -> None:
    codes = np.arange(256, dtype=np.int32)
    table = q.dynamic_map(signed)
    np.testing.assert_array_equal(_decode(codes, signed).view(np.uint32), table.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(q._selected(jnp.asarray(codes), jnp.asarray(table))),
                                  _decode(codes, signed))


@SIGNS
def test_decoding_midpoints_are_the_map_midpoints(signed: bool) -> None:
    """`_encoded` compares with `(value(c) + value(c + 1)) / 2` of decoded entries: bitwise
    `midpoints`."""
    values = _decode(np.arange(256, dtype=np.int32), signed)
    mids = (values[:-1] + values[1:]) / np.float32(2)
    np.testing.assert_array_equal(mids.view(np.uint32), q.midpoints(signed).view(np.uint32))


@SIGNS
def test_encoding_at_every_midpoint_and_beside_it(signed: bool) -> None:
    """Each midpoint (a tie goes up), the float32 just below and just above it, the
    entries themselves (each its own code) and the special values (NaN's count is 0)."""
    mids = q.midpoints(signed)
    table = q.dynamic_map(signed)
    x = np.concatenate([mids, np.nextafter(mids, np.float32(-2)), np.nextafter(mids, np.float32(2)),
                        table, -table, SPECIAL])
    codes = _encode(x, signed)
    np.testing.assert_array_equal(codes, _count(x, signed))
    np.testing.assert_array_equal(codes, np.asarray(q._counted(jnp.asarray(x), jnp.asarray(mids))))
    np.testing.assert_array_equal(_encode(table, signed), np.arange(256))
    np.testing.assert_array_equal(codes[:mids.size], np.arange(1, 256))
    np.testing.assert_array_equal(codes[mids.size:2 * mids.size], np.arange(255))


@SIGNS
def test_encoding_random_bit_patterns(signed: bool) -> None:
    """2M float32 of uniformly random bits (every exponent, subnormals, NaNs), and 1M
    in [-1, 1] of uniform magnitude over eight decades."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 32, 1 << 21, dtype=np.uint64).astype(np.uint32).view(np.float32)
    decades = (rng.uniform(-1, 1, 1 << 20) * 10.0 ** rng.uniform(-8, 0, 1 << 20)).astype(np.float32)
    for x in (bits, decades):
        np.testing.assert_array_equal(_encode(x, signed), _count(x, signed))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=hnp.arrays(np.float32, 512, elements=st.floats(-1, 1, width=32)),
       signed=st.booleans())
def test_encoding_hypothesis(x: np.ndarray, signed: bool) -> None:
    np.testing.assert_array_equal(_encode(x, signed), _count(x, signed))


def test_an_accelerator_neither_gathers_nor_passes_over_the_map() -> None:
    """Lowered for a TPU (no chip needed), `lookup` and `codes_and_scales` hold no gather
    and no array with an axis of the map's 256 entries or 255 midpoints (what the
    comparison forms, `_selected` and `_counted`, build; the scales' blocks of 256 are
    another axis)."""
    codes = jnp.zeros((8, 1000), jnp.uint8)
    values = jnp.zeros((8, 1000), jnp.float32)
    for signed in (True, False):
        for fn, arg, axis in ((q.lookup, codes, "x256x"), (q.codes_and_scales, values, "x255x")):
            text = jax.jit(fn, static_argnums=1).trace(arg, signed).lower(
                lowering_platforms=("tpu",)).as_text()
            assert "gather" not in text and axis not in text
    cpu = jax.jit(q.lookup, static_argnums=1).trace(codes, True).lower().as_text()
    assert "gather" in cpu  # (the CPU's look-up: a gather is its fastest)

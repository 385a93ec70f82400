"""8-bit block-wise quantised optimizer state (`offloaded(..., host_dtype=jnp.int8)`): the
codec `Blockwise8Bit` (`codec`), and its arithmetic.

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (arXiv:2110.02861), as
bitsandbytes and torchao implement it: each block of `BLOCK` (256) consecutive values is
scaled by its largest magnitude, and each scaled value is stored as the 8-bit index of
the nearest entry of a *dynamic map* (bitsandbytes' `create_dynamic_map`): the signed map
for first moments (`mu`, `trace`), the unsigned map for second moments (`nu`, `nu_max`,
`sum_of_squares`), as bitsandbytes and torchao assign them. Each code is the map's
nearest entry, a tie going up, as torchao's `quantize_8bit_with_qmap` rounds (found
without gathers, which XLA:TPU runs slowly: `codes_and_scales`, `lookup`).

How a quantised leaf `(..., r, n)` is stored: one `uint32` array `(..., r + e,
ceil(n / 4))` (`packed_shape`): its rows of one-byte codes, four a word, then `e` rows
that hold the rows' float32 scales. Word `j` of a row of `w` words holds the codes of
columns `j`, `j + w`, `j + 2w` and `j + 3w`, from its lowest byte: each quarter of a row
is a slab of whole words, so that packing and unpacking are shifts of whole slabs, along
the lanes of a TPU, where four neighbouring bytes a word took a transposition. 32-bit words, and a last axis of `n / 4` words:
XLA:TPU did not compile some other forms (a uint8 `(32000, 2080)` moment, whose host
and device memories tile it differently; a uint32 `(8, 2048, 1430)` moment read a layer
at a time, codes and scales along one axis). Blocks run along the last axis (a row's last block may be
shorter), so every leading axis keeps its meaning: the streamed update reads and writes
whole rows of a stacked leaf as it does for any other. For a last axis that is a multiple
of 256 the blocks are torchao's and bitsandbytes' (they block the flattened array).
Leaves of fewer than `MIN_SIZE` (4096) values keep their dtype, as in both references.

Stacked layers (`layers=`: `Options.stacked`, set on the transformation of
`update_in_backward`'s stacked layers): each layer of a state leaf is packed apart, so
that a layer is a slice of the stored array along its leading axis. Only a stack of
vectors `(L, n)` is stored otherwise: as `(L, 1 + e, ceil(n / 4))`, each layer a one-row
leaf, where alone it would be `(L + e, ceil(n / 4))` (the codes and scales are the same:
blocks run along the last axis). Whether a leaf is kept quantised is decided by the
values of the whole stack, as for the stack alone; a stack of scalars `(L,)` keeps its
dtype.
"""

import dataclasses
import functools
import math
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .._core.leaves import KeyPath
from .codec import AbstractCodec


BLOCK = 256
"""Values per block (one float32 scale each), torchao's and bitsandbytes' block size."""
MIN_SIZE = 4096
"""Smaller leaves keep their dtype (torchao's and bitsandbytes' threshold)."""
SIGNED_FIELDS = frozenset({"mu", "trace"})
"""State fields quantised with the signed map: first moments (optax's Adam, Lion, SGD
momentum)."""
UNSIGNED_FIELDS = frozenset({"nu", "nu_max", "sum_of_squares"})
"""State fields quantised with the unsigned map: second moments (optax's Adam, AMSGrad,
RMSProp, AdaGrad)."""
CODE_DTYPE = np.dtype(np.uint32)
"""The dtype a quantised leaf is stored in: four codes a word, then a word per scale."""
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A leaf kept quantised: the `dtype` and `shape` that `inner.init` gives it (what it
    is widened back to), and which map it uses."""

    dtype: np.dtype
    shape: tuple[int, ...]
    signed: bool
    rows: bool = False  # a stack of vectors, each layer packed as a one-row leaf

    @property
    def spec(self) -> jax.ShapeDtypeStruct:
        """The leaf as the update computes on it."""
        return jax.ShapeDtypeStruct(self.shape, self.dtype)

    @property
    def packed(self) -> tuple[int, ...]:
        """The stored shape."""
        if self.rows:
            return (self.shape[0], *packed_shape(self.shape[1:]))
        return packed_shape(self.shape)

    @property
    def unpacked(self) -> tuple[int, ...]:
        """The shape `unpack` reads the stored array as."""
        return (self.shape[0], 1, self.shape[1]) if self.rows else self.shape


def dynamic_map(signed: bool) -> np.ndarray:
    """bitsandbytes' dynamic map (`create_dynamic_map(signed, 7, 8)`), as torchao makes it
    (in float32): 256 sorted values in [-1, 1] (signed) or [0, 1], dense near 0."""
    data: list[float] = []
    for i in range(7):  # one decade per exponent, 10^-6 .. 10^0
        items = 2 ** i if signed else 2 ** (i + 1)
        bounds = np.linspace(0.1, 1, items + 1, dtype=np.float32)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        decade = np.float32(10.0 ** (i - 6)) * means
        data += decade.tolist()
        if signed:
            data += (-decade).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return np.sort(np.asarray(data, np.float32))


@functools.lru_cache(maxsize=2)
def _map(signed: bool) -> np.ndarray:
    qmap = dynamic_map(signed)
    qmap.flags.writeable = False
    return qmap


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored shape of a leaf of `shape` `(..., r, n)`: `(..., r + e, ceil(n / 4))`
    32-bit words, its `r` rows of codes (four a word) and then `e` rows holding the
    rows' `r * ceil(n / 256)` float32 scales (zero-padded). A vector `(n,)` is one row."""
    *lead, r, n = (1, *shape) if len(shape) == 1 else shape
    words = -(-n // 4)
    extra = -(-(r * -(-n // BLOCK)) // words)
    return (*([] if len(shape) == 1 else lead), r + extra, words)


def spec_for(path: tuple[Any, ...], leaf: Any,
             layers: Optional[int] = None) -> Optional[Quantized]:
    """How a state leaf at `path` (a JAX key path) is kept under 8-bit state: a
    `Quantized` for a floating array of at least `MIN_SIZE` values under a first- or
    second-moment field (the first such field on its path decides), else `None`.
    `layers`: the leaf is of that many stacked layers, or of one slice of them (each
    layer packed apart; see the module's docstring)."""
    dtype, shape = getattr(leaf, "dtype", None), getattr(leaf, "shape", None)
    if (dtype is None or shape is None or len(shape) == 0
            or not jnp.issubdtype(dtype, jnp.floating) or (layers is not None and len(shape) < 2)):
        return None
    size = math.prod(shape) if layers is None else layers * math.prod(shape[1:])
    if size < MIN_SIZE:
        return None
    for key in path:
        name = getattr(key, "name", None)  # a NamedTuple's or dataclass's field
        if name in SIGNED_FIELDS or name in UNSIGNED_FIELDS:
            return Quantized(np.dtype(dtype), tuple(shape), name in SIGNED_FIELDS,
                             rows=layers is not None and len(shape) == 2)
    return None


class Blockwise8Bit(AbstractCodec):
    """Adam's moments kept 8-bit block-wise quantised (`host_dtype=jnp.int8`): a leaf's
    spec is its `Quantized` (`spec_for`), its stored form `quantize`'s packed words."""

    fences_init: ClassVar[bool] = True  # (quantising is ~80 operations a value)

    def specs(self, paths: Sequence[KeyPath], leaves: Sequence[Any],
              layers: Optional[int]) -> list[Optional[Hashable]]:
        return [spec_for(p, x, layers) for p, x in zip(paths, leaves, strict=True)]

    def narrow(self, leaf: ArrayLike, spec: Hashable) -> ArrayLike:
        assert isinstance(spec, Quantized)
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating):
            packed: jax.Array = quantize(leaf, spec.signed, spec.rows)  # (jitted: Any)
            return packed
        return leaf

    def widen(self, leaf: ArrayLike, spec: Hashable) -> ArrayLike:
        assert isinstance(spec, Quantized)
        return dequantize(leaf, spec) if getattr(leaf, "dtype", None) == CODE_DTYPE else leaf

    def computes_in(self, dtype: Any, spec: Hashable) -> Any:
        assert isinstance(spec, Quantized)
        return spec.spec if dtype == CODE_DTYPE else dtype

    def stored(self, spec: Hashable) -> jax.ShapeDtypeStruct:
        assert isinstance(spec, Quantized)
        return jax.ShapeDtypeStruct(spec.packed, CODE_DTYPE)


def _blocks(x: Any) -> Any:
    """`x` (..., n) as (..., blocks, BLOCK), zero-padded."""
    n = x.shape[-1]
    blocks = -(-n // BLOCK)
    pad = [(0, 0)] * (x.ndim - 1) + [(0, blocks * BLOCK - n)]
    return jnp.pad(x, pad).reshape(*x.shape[:-1], blocks, BLOCK)


def midpoints(signed: bool) -> np.ndarray:
    """The 255 points halfway between neighbouring entries of the map (float32): a
    value's code is how many of them it reaches."""
    qmap = _map(signed)
    mids: np.ndarray = (qmap[:-1] + qmap[1:]) / np.float32(2)
    return mids


def codes_and_scales(x: Any, signed: bool) -> tuple[Any, Any]:
    """`x` (..., n) quantised: its uint8 codes (..., n) and float32 scales (..., blocks).
    torchao's `scale_tensor`, blocked along the last axis; each code is the nearest
    entry of the map, a tie going up, as torchao's `quantize_8bit_with_qmap` rounds:
    the number of midpoints (`midpoints`) the value reaches."""
    x = x.astype(jnp.float32)
    scales = _scales(x)
    return _encoded(x / _spread(scales, x.shape, 0), signed).astype(jnp.uint8), scales


# A row's blocks are lanes of it: so that XLA:TPU keeps a row's values along lanes, as
# they come, an accelerator blocks a row of at most `_SLICED` blocks by slices of its
# last axis (each block's largest magnitude a reduction of one slice, each value's scale
# a select among its neighbours' blocks); reshaped to `(..., blocks, BLOCK)` (and so
# transposed by XLA:TPU), the values were copied twice more. The CPU, and any longer row,
# reshapes (the same values: on the CPU the update inside the backward pass is bitwise the
# normal step's with it, and XLA:CPU rounded Adam's moments otherwise around slices).
_SLICED = 128


def _scales(x: Any) -> Any:
    """Each block's largest magnitude (at least 1e-12), float32 (..., blocks)."""
    if -(-x.shape[-1] // BLOCK) > _SLICED:
        return _reshaped_scales(x)
    return jax.lax.platform_dependent(x, cpu=_reshaped_scales, default=_sliced_scales)


def _reshaped_scales(x: Any) -> Any:
    return jnp.maximum(jnp.max(jnp.abs(_blocks(x)), axis=-1), jnp.float32(1e-12))


def _sliced_scales(x: Any) -> Any:
    blocks = -(-x.shape[-1] // BLOCK)
    largest = jnp.concatenate([jnp.max(jnp.abs(x[..., b * BLOCK:(b + 1) * BLOCK]), axis=-1,
                                       keepdims=True) for b in range(blocks)], axis=-1)
    return jnp.maximum(largest, jnp.float32(1e-12))


def _spread(scales: Any, shape: tuple[int, ...], start: int) -> Any:
    """The scale of each value of columns `start ..` of a row (`shape`: those columns'),
    from the rows' `scales` (..., blocks); a column past the last block takes its scale."""
    reshaped = functools.partial(_reshaped_spread, shape=shape, start=start)
    if scales.shape[-1] > _SLICED:
        return reshaped(scales)
    return jax.lax.platform_dependent(scales, cpu=reshaped, default=functools.partial(
        _sliced_spread, shape=shape, start=start))


def _reshaped_spread(scales: Any, shape: tuple[int, ...], start: int) -> Any:
    blocks = scales.shape[-1]
    spread = jnp.broadcast_to(scales[..., None], (*scales.shape, BLOCK)).reshape(
        *scales.shape[:-1], blocks * BLOCK)
    return jnp.pad(spread, [(0, 0)] * (len(shape) - 1) + [(0, BLOCK)])[..., start:start + shape[-1]]


def _sliced_spread(scales: Any, shape: tuple[int, ...], start: int) -> Any:
    blocks, width = scales.shape[-1], shape[-1]
    first, last = start // BLOCK, min((start + width - 1) // BLOCK, blocks - 1)
    column = jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1) + start
    spread = jnp.broadcast_to(scales[..., first:first + 1], shape)
    for b in range(first + 1, last + 1):
        spread = jnp.where(column >= b * BLOCK, scales[..., b:b + 1], spread)
    return spread


def _searched(scaled: Any, mids: Any) -> Any:
    """The midpoints at or below each value, by binary search: eight halving steps over
    the 255 sorted midpoints, each a lookup and a comparison (a reference for
    `_encoded`, which the CPU also runs faster)."""
    count = jnp.zeros(scaled.shape, jnp.int32)
    for step in (128, 64, 32, 16, 8, 4, 2, 1):
        candidate = count + step
        below = jnp.take(mids, jnp.minimum(candidate, mids.shape[0]) - 1) <= scaled
        count = jnp.where((candidate <= mids.shape[0]) & below, candidate, count)
    return count


def _counted(scaled: Any, mids: Any) -> Any:
    """The same count, by 255 comparisons that XLA fuses into one reduction (the
    reference `_encoded` is checked against: 255 comparisons a value)."""
    return jnp.sum(scaled[..., None] >= mids, axis=-1, dtype=jnp.int32)


def lookup(codes: Any, signed: bool) -> Any:
    """`map[codes]` (float32), exactly: a gather on the CPU; on an accelerator (where a
    gather of 16M codes took 161 ms on a TPU v5e) computed from each code, elementwise
    (`_decoded`)."""
    table = jnp.asarray(_map(signed))
    return jax.lax.platform_dependent(codes.astype(jnp.int32), table, cpu=_gathered,
                                      default=functools.partial(_decoded_from, signed=signed))


def _decoded_from(codes: Any, _table: Any, signed: bool) -> Any:
    return _decoded(codes, signed)


def _gathered(codes: Any, table: Any) -> Any:
    return jnp.take(table, codes)


def _selected(codes: Any, table: Any) -> Any:
    """The same look-up by a sum over the 256 entries with one non-zero term (the
    reference `_decoded` is checked against: 256 selects a value)."""
    return jnp.sum(jnp.where(codes[..., None] == jnp.arange(256), table, 0.0), axis=-1)


# The map by arithmetic. Past 0 and 1.0, the map's non-negative entries run in 7 levels;
# level i has n entries (n = 2^i signed, 2^(i+1) unsigned), the k-th of them
# `dec * (b[k] + b[k+1]) / 2` in float32, where dec = float32(10^(i-6)) and b is
# `np.linspace(0.1, 1, n + 1, dtype=float32)`: b[k] = m / (10 n) rounded to float32, for
# the integer m = n + 9k (the linspace's float64 error, ~1e-16, is far below what
# separates m / 10 from a rounding boundary: see `_bound`). An entry's positive index (0
# for 0) is the level's first index + k, first = n (signed) or n - 1 (unsigned); a
# signed map's code is 127 + that index, or 127 - it for a negative entry, the unsigned
# map's code is the index.
#
# Exact whatever a compiler does with float32 arithmetic: XLA:TPU treats it as real
# numbers (it rewrote `m * a + m * b` as `m * (a + b)`, which rounds once), and a chip
# may fuse a product into a sum. So each op that rounds takes operands that are exact
# and opaque to that algebra (converted from integers, or a float32's bits moved by an
# integer op), and where its result meets another rounding op it passes through an
# integer op first.

_TENTH_FACTOR = 949
# 0.1 / 949 in float32: 949 times it is 0.1 within 1.5e-11 (relative), the closest of
# any multiplier under 2^13.
_TENTH_SCALE = np.float32(0.1 / _TENTH_FACTOR)


def _bound(x: Any, shift: Any) -> Any:
    """b = m / (10 n) rounded to float32 (to nearest) for `x` = 949 m (int32, 0 < m <
    17678) and `shift` = log2(n) << 23: float32(x) is exact (x < 2^24), and so is its
    product with `_TENTH_SCALE` before its one rounding but for 1.5e-11 of m / 10, while
    m / 10 lies at least 1/20 ulp (over 2.9e-9 of it) from a rounding boundary (a boundary
    is a multiple of 2^(e-1), m / 10 one of 2^(e-1) / 10, and they meet only where m / 10
    is a float32). Over n by the exponent's bits: exact, and no float op for XLA to fold."""
    tenth = x.astype(jnp.float32) * _TENTH_SCALE
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(tenth, jnp.int32) - shift, jnp.float32)


def _halved(x: Any) -> Any:
    """`x / 2` for a positive normal float32 `x`, by its exponent's bits (exact)."""
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x, jnp.int32) - (1 << 23), jnp.float32)


@functools.lru_cache(maxsize=2)
def _levels(signed: bool) -> tuple[tuple[Any, Any, Any, Any], ...]:
    """Each level's `n`, `dec` (float32(10^(i-6))), the slope `n / (0.9 dec)` (a value's
    position in the level, for a first guess) and the midpoint below its first entry."""
    positive = midpoints(signed)[127:] if signed else midpoints(signed)
    levels = []
    for i in range(7):
        n = 2 ** i if signed else 2 ** (i + 1)
        dec = np.float32(10.0 ** (i - 6))
        first = n if signed else n - 1
        levels.append((n, dec, np.float32(n / (0.9 * np.float64(dec))), positive[first - 1]))
    return tuple(levels)


def _decoded(codes: Any, signed: bool) -> Any:
    """`map[codes]` (float32) bitwise, by elementwise arithmetic on the int32 codes (no
    gather, no table): about 40 operations a value."""
    codes = codes.astype(jnp.int32)
    index = jnp.abs(codes - 127) if signed else codes  # the positive index
    q = index if signed else index + 1  # n + k within a level
    safe = jnp.maximum(q, 1)  # (0 for the signed map's 0: any level's arithmetic will do)
    exponent = jax.lax.bitcast_convert_type(safe.astype(jnp.float32), jnp.int32) & -(1 << 23)
    n = jax.lax.bitcast_convert_type(exponent, jnp.float32).astype(jnp.int32)  # 2^floor(log2)
    shift = exponent - (127 << 23)
    x = _TENTH_FACTOR * (9 * safe - 8 * n)  # m = n + 9k, k = q - n
    sums = _bound(x, shift) + _bound(x + 9 * _TENTH_FACTOR, shift)  # b[k] + b[k + 1]
    half_dec: Any = np.float32(0)  # (0 below the first level)
    for level_n, dec, _, _ in _levels(signed):
        half_dec = jnp.where(q >= level_n, dec / np.float32(2), half_dec)
    value = sums * half_dec  # = round(sums * dec) / 2: one rounding, of exact operands
    value = jnp.where(q >= 2 * _levels(signed)[-1][0], np.float32(1), value)  # (past them)
    return jnp.where(codes < 127, -value, value) if signed else value


@jax.jit(static_argnames=("signed",))  # (`quantize` calls it 4 times a shape)
def _encoded(scaled: Any, signed: bool) -> Any:
    """The number of midpoints (`midpoints`) at or below each float32 value (`_counted`)
    bitwise, elementwise: its level from 8 comparisons with the midpoints that bound
    the levels, a guess at its entry within the level from its position there (never
    above the count, at most one below), and one comparison with the midpoint that
    decides, computed as NumPy does: about 80 operations a value."""
    x = scaled.astype(jnp.float32)
    levels = _levels(signed)
    negative = x < 0
    if signed:
        # A negative value's count is 127 less the positive midpoints below its
        # magnitude (the map is symmetric but for 1.0): at or below the float32 under it.
        magnitude = jax.lax.bitcast_convert_type(jnp.abs(x), jnp.int32) - negative
        a = jax.lax.bitcast_convert_type(magnitude, jnp.float32)
    else:
        a = x
    first_n, dec, slope, _ = levels[0]
    shift: Any = np.int32(int(np.log2(first_n)) << 23)
    for level_n, level_dec, level_slope, bottom in levels[1:]:
        above = a >= bottom
        shift = jnp.where(above, np.int32(int(np.log2(level_n)) << 23), shift)
        dec = jnp.where(above, level_dec, dec)
        slope = jnp.where(above, level_slope, slope)
    n_float = jax.lax.bitcast_convert_type(shift + (127 << 23), jnp.float32)
    # The entry k of the level at or below the value: its midpoints sit at whole
    # positions 1 .. n - 1 (within 1e-5, as computed here), so this guess is the count
    # within the level, or one less where the position is within 1/64 of a whole one.
    position = a * slope - n_float * np.float32(1 / 9)
    k = jnp.maximum(jnp.minimum(jnp.floor(position - np.float32(1 / 64)), n_float - 2), 0)
    n, k = n_float.astype(jnp.int32), k.astype(jnp.int32)
    m = _TENTH_FACTOR * (n + 9 * k)
    low, mid, high = (_bound(m + j * 9 * _TENTH_FACTOR, shift) for j in range(3))
    # The entries k and k + 1 (halved by their bits, opaque to XLA's algebra), and the
    # midpoint between them as `midpoints` rounds it: `(low + high) / 2`.
    below, over = _halved((low + mid) * dec), _halved((mid + high) * dec)
    up = a + a >= below + over
    if signed:
        up = up & (k < n - 1)  # (level 0 has one entry)
    count = (n if signed else n - 1) + k + up
    count = jnp.where(a >= levels[0][3], count, 0)
    count = jnp.where(a >= midpoints(signed)[-1], 128 if signed else 255, count)
    if signed:
        count = jnp.where(negative, 127 - jnp.minimum(count, 127), 127 + count)
        count = jnp.where(jnp.isnan(x), 0, count)
    return count


# `quantize` and `dequantize` are jitted: each traces once per shape, dtype and map, and
# a step that stores many leaves of a few shapes (a layer's pieces, the moments) calls
# that one jaxpr (XLA inlines the calls: the same program). Traced per call, the ~80
# operations a value took most of the tracing of a step with 8-bit state.
@jax.jit(static_argnames=("signed", "rows"))
def quantize(x: Any, signed: bool, rows: bool = False) -> jax.Array:
    """`x` in its packed form, uint32 of `packed_shape(x.shape)`, on `x`'s device (with
    `rows`, a stack of vectors `(L, n)` packed a layer at a time: `Quantized.packed`).
    Word `j` of a row holds the codes of columns `j`, `j + w`, `j + 2w` and `j + 3w` (`w`
    words a row), in its bytes from the lowest: each quarter of the row a whole slab of
    words, four shifts apart (columns past the row's end: code 0)."""
    if rows:
        x = x[:, None, :]
    x = (x if x.ndim > 1 else x[None]).astype(jnp.float32)
    *lead, r, n = x.shape
    scales = _scales(x)
    words = -(-n // 4)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 4 * words - n)])
    coded: Any = None
    for k in range(4):
        part = padded[..., k * words:(k + 1) * words]
        codes = _encoded(part / _spread(scales, part.shape, k * words), signed)
        if (k + 1) * words > n:
            column = jax.lax.broadcasted_iota(jnp.int32, part.shape, x.ndim - 1)
            codes = jnp.where(column < n - k * words, codes, 0)
        shifted = codes.astype(jnp.uint32) << np.uint32(8 * k)
        coded = shifted if coded is None else coded | shifted
    flat = jax.lax.bitcast_convert_type(scales, jnp.uint32).reshape(*lead, -1)
    extra = -(-flat.shape[-1] // words)
    flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, extra * words - flat.shape[-1])])
    return jnp.concatenate([coded, flat.reshape(*lead, extra, words)], axis=-2)


def unpack(packed: Any, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """The codes `(..., r, n)` (int32) and float32 scales `(..., r, blocks)` of a packed
    array (of a leaf of `shape`, or of rows along its first axis); a vector is one row.
    Column `c` of a row is byte `c // w` of its word `c % w` (`quantize`): each quarter
    of the row is its words shifted, the four side by side."""
    *_, r, n = (1, *shape) if len(shape) == 1 else shape
    words = packed[..., :r, :]
    codes = jnp.concatenate([(words >> np.uint32(8 * k)) & np.uint32(0xFF) for k in range(4)],
                            axis=-1)[..., :n].astype(jnp.int32)
    return codes, _stored_scales(packed, r, n)


def _stored_scales(packed: Any, r: int, n: int) -> Any:
    """The float32 scales `(..., r, blocks)` of a packed array of rows of `n` values."""
    lead, blocks = packed.shape[:-2], -(-n // BLOCK)
    flat = packed[..., r:, :].reshape(*lead, -1)[..., :r * blocks]
    return jax.lax.bitcast_convert_type(flat, jnp.float32).reshape(*lead, r, blocks)


@jax.jit(static_argnames=("spec",))
def dequantize(packed: Any, spec: Quantized) -> Any:
    """A packed array (of `spec`'s leaf, or rows of it) back in `spec.dtype`:
    `map[code] * scale`, as torchao's `dequant_with_qmap`."""
    *_, r, n = (1, *spec.unpacked) if len(spec.unpacked) == 1 else spec.unpacked
    # (`unpack`'s codes, as each column's byte shifted out of its word repeated four times:
    # XLA fuses that into the decoding, where it wrote `unpack`'s four slabs out first)
    repeated = jnp.concatenate([packed[..., :r, :]] * 4, axis=-1)[..., :n]
    column = jax.lax.broadcasted_iota(jnp.int32, repeated.shape, repeated.ndim - 1)
    codes = ((repeated >> (column // packed.shape[-1] * 8).astype(jnp.uint32))
             & np.uint32(0xFF)).astype(jnp.int32)
    values = lookup(codes, spec.signed) * _spread(_stored_scales(packed, r, n), codes.shape, 0)
    if spec.rows:
        return values[..., 0, :].astype(spec.dtype)
    return (values if len(spec.shape) > 1 else values[0]).astype(spec.dtype)

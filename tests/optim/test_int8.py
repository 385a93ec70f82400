"""8-bit optimizer state (`offloaded(..., host_dtype=jnp.int8)`, `_optim/quantize.py`).

Not bitwise the fp32 update: the quantiser is checked against a NumPy reference of the
same quantisation (bitsandbytes' `create_dynamic_map` and torchao's `scale_tensor` and
`quantize_8bit_with_qmap`, re-implemented in NumPy from their code): the map and the
scales bitwise equal, the codes equal but where a value is a float32 rounding away from
the midpoint of two entries. Each way the state comes to the device (whole, `"auto"` under `jit`,
streamed in rows of a stacked leaf) is then bitwise the *emulation*: the fp32 update on the
dequantised state, its new moments quantised (the quantiser above)."""


import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import assert_tree_equal

import eqx_offload
from eqx_offload._optim import quantize as q


# ----------------------------------------------------------------------------------------
# The NumPy reference


def reference_map(signed: bool) -> np.ndarray:
    """bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)` as
    torchao copies it, in NumPy float32."""
    data: list[float] = []
    non_sign_bits = 7
    for i in range(7):
        items = 2 ** (i + non_sign_bits - 7) + 1 if signed else 2 ** (i + non_sign_bits - 7 + 1) + 1
        boundaries = np.linspace(0.1, 1, items, dtype=np.float32)
        means = (boundaries[:-1] + boundaries[1:]) / np.float32(2.0)
        data += (np.float32(10 ** (-(7 - 1) + i)) * means).tolist()
        if signed:
            data += (-np.float32(10 ** (-(7 - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    data.sort()
    return np.asarray(data, np.float32)


def reference_quantize(x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """torchao's `scale_tensor` (blocks of 256 of the flattened array) and
    `quantize_8bit_with_qmap` (branchless binary search, then rounding), in NumPy."""
    qmap = reference_map(signed)
    blocks = x.astype(np.float32).reshape(-1, 256)
    scale = np.maximum(np.abs(blocks).max(-1), np.float32(1e-12))
    y = (blocks / scale[:, None]).reshape(-1)
    codes = np.where(y >= qmap[128], 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
        codes += np.where(y >= qmap[codes + step], step, 0)
    up = np.minimum(codes + 1, 255)
    codes = np.where(y - qmap[codes] >= (qmap[up] - qmap[codes]) * np.float32(0.5), up, codes)
    return codes.astype(np.uint8).reshape(x.shape), scale


def _samples(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Values over many magnitudes, with a zero block and a block of one sign."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= (10.0 ** rng.uniform(-9, 1, shape[:-1] + (1,))).astype(np.float32)
    flat = x.reshape(-1)
    flat[:256] = 0
    flat[256:512] = np.abs(flat[256:512])
    return x


def test_the_maps_are_bitsandbytes() -> None:
    for signed in (True, False):
        qmap = q.dynamic_map(signed)
        np.testing.assert_array_equal(qmap, reference_map(signed))
        assert len(np.unique(qmap)) == 256 and qmap[-1] == 1 and 0 in qmap
        assert (qmap.min() < -0.99) == signed and (qmap.min() == 0) == (not signed)


@pytest.mark.parametrize("signed", [True, False])
def test_quantiser_is_the_reference(signed: bool) -> None:
    """Last axis a multiple of 256: the blocks are torchao's (of the flattened array).
    The scales are torchao's bitwise; each code is the number of midpoints between the
    map's entries that the scaled value reaches (bitwise, against NumPy's
    `searchsorted`), which is torchao's code except where the value lies within float32
    rounding of a midpoint: there the two codes are neighbours, and both the nearest
    entry to that rounding."""
    x = _samples((6, 512), seed=1)
    if not signed:
        x = x * x
    codes, scales = jax.jit(q.codes_and_scales, static_argnums=1)(x, signed)
    codes = np.asarray(codes)
    ref_codes, ref_scales = reference_quantize(x, signed)
    np.testing.assert_array_equal(np.asarray(scales).reshape(-1), ref_scales)
    y = (x.reshape(-1, 256) / ref_scales[:, None]).reshape(x.shape)
    qmap = reference_map(signed)
    mids = (qmap[:-1] + qmap[1:]) / np.float32(2)
    np.testing.assert_array_equal(codes, np.searchsorted(mids, y, side="right"))
    differ = codes != ref_codes
    assert differ.mean() < 1e-3
    assert np.all(np.abs(codes[differ].astype(int) - ref_codes[differ]) == 1)
    near = mids[np.minimum(codes, ref_codes)[differ]]
    assert np.all(np.abs(y[differ] - near) <= 2 * np.spacing(np.abs(near)))


def test_the_accelerator_paths_equal_the_cpu_paths() -> None:
    """The code count by comparisons and the table look-up by selects (what an
    accelerator runs) equal the binary search and the gather (the CPU's), bitwise."""
    x = jnp.asarray(_samples((8, 1024), seed=4).reshape(-1) / 20)
    for signed in (True, False):
        mids = jnp.asarray(q.midpoints(signed))
        np.testing.assert_array_equal(q._counted(x, mids), q._searched(x, mids))
        table = jnp.asarray(q.dynamic_map(signed))
        codes = jnp.arange(256, dtype=jnp.int32)
        np.testing.assert_array_equal(q._selected(codes, table), q._gathered(codes, table))
        np.testing.assert_array_equal(q._gathered(codes, table), q.dynamic_map(signed))


def test_rows_are_blocked_along_the_last_axis() -> None:
    """A row of 300 values: a block of 256 and one of 44 (each the reference on the
    zero-padded row)."""
    x = _samples((5, 300), seed=2)
    codes, scales = q.codes_and_scales(jnp.asarray(x), True)
    padded = np.pad(x, [(0, 0), (0, 212)])
    ref_codes, ref_scales = reference_quantize(padded, True)
    np.testing.assert_array_equal(np.asarray(codes), ref_codes[:, :300])
    np.testing.assert_array_equal(np.asarray(scales).reshape(-1), ref_scales)


@pytest.mark.parametrize("signed", [True, False])
def test_round_trip_within_half_a_step_of_the_map(signed: bool) -> None:
    """Dequantised, each value is as near as the map's nearest entry, times its block's
    scale (to float32 rounding): at most 0.0071 of the block's largest magnitude for the
    signed map, 0.0036 for the unsigned."""
    x = _samples((4, 1024), seed=3)
    if not signed:
        x = np.abs(x)
    spec = q.Quantized(np.dtype(np.float32), x.shape, signed)
    packed = q.quantize(jnp.asarray(x), signed)
    assert packed.dtype == jnp.uint32 and packed.shape == q.packed_shape(x.shape) == (5, 256)
    back = np.asarray(q.dequantize(packed, spec))
    qmap = reference_map(signed)
    scale = np.repeat(np.maximum(np.abs(x.reshape(-1, 256)).max(-1), 1e-12), 256).reshape(x.shape)
    nearest = np.abs(qmap[None, :] - (x / scale).reshape(-1, 1)).min(-1).reshape(x.shape)
    assert np.all(np.abs(back - x) <= (nearest + 2.0 ** -22) * scale)
    assert nearest.max() <= (0.0071 if signed else 0.0036)


def test_the_codec_is_traced_once_per_shape() -> None:
    """Many leaves of one shape (a layer's pieces, each moment) call one traced
    `quantize` and one `dequantize`, whose encoding is traced once for its four quarters."""
    spec = q.Quantized(np.dtype(np.float32), (8, 1030), True)

    def step(xs: list[jax.Array]) -> list[jax.Array]:
        return [q.dequantize(q.quantize(x, True), spec) for x in xs]

    jaxpr = jax.make_jaxpr(step)([jnp.zeros(spec.shape)] * 3)
    calls = [e for e in jaxpr.eqns if "jaxpr" in e.params]
    for name in ("quantize", "dequantize"):
        inner = {id(e.params["jaxpr"]) for e in calls if e.params.get("name") == name}
        assert len(inner) == 1
    quantize = next(e for e in calls if e.params["name"] == "quantize").params["jaxpr"]
    encoded = [e for e in quantize.eqns if e.params.get("name") == "_encoded"]
    assert len(encoded) == 4 and len({id(e.params["jaxpr"]) for e in encoded}) == 1
    assert len([e for e in calls if e.params.get("name") == "quantize"]) == 3


def test_a_word_holds_a_code_of_each_quarter_of_its_row() -> None:
    """Rows of 1030 values in 258 words: word j holds the codes of columns j, j + 258, j +
    516 and j + 774 from its lowest byte (columns past 1030: code 0); then the rows'
    scales, a word each, in rows of 258."""
    x = _samples((3, 1030), seed=5)
    codes, scales = (np.asarray(a) for a in q.codes_and_scales(jnp.asarray(x), True))
    packed = np.asarray(q.quantize(jnp.asarray(x), True))
    assert packed.shape == q.packed_shape(x.shape) == (4, 258)
    quarters = np.pad(codes, [(0, 0), (0, 2)]).reshape(3, 4, 258).astype(np.uint32)
    np.testing.assert_array_equal(packed[:3], sum(quarters[:, k] << (8 * k) for k in range(4)))
    assert np.all(quarters[:, 3, -2:] == 0)
    np.testing.assert_array_equal(packed[3, :15], scales.reshape(-1).view(np.uint32))
    assert np.all(packed[3, 15:] == 0)
    unpacked = q.unpack(jnp.asarray(packed), x.shape)
    np.testing.assert_array_equal(unpacked[0], codes)
    np.testing.assert_array_equal(unpacked[1], scales)


@pytest.mark.parametrize("shape", [(3, 1030), (2, 5632), (2, 3, 300)])
def test_rows_blocked_by_slices_or_by_a_reshape_are_the_same(shape) -> None:
    """An accelerator blocks a row by slices of it, the CPU by a reshape: the same
    scales and the same scale for each value, bitwise (with infinities and -0.0)."""
    x = _samples(shape, seed=6)
    x.reshape(-1)[[600, 900, 1000]] = [np.inf, -np.inf, -0.0]
    scales = q._sliced_scales(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint32),
                                  np.asarray(q._reshaped_scales(jnp.asarray(x))).view(np.uint32))
    words = -(-shape[-1] // 4)
    for start in range(0, 4 * words, words):
        part = (*shape[:-1], words)
        np.testing.assert_array_equal(q._sliced_spread(scales, part, start),
                                      q._reshaped_spread(scales, part, start))


# ----------------------------------------------------------------------------------------
# `offloaded(..., host_dtype=jnp.int8)`


ADAM = optax.adam(1e-2)


def _params() -> dict[str, jax.Array]:
    """A stacked leaf (4 layers of 64 x 128: one short block a row), a matrix whose rows
    are two blocks (300 values), and a bias too small to quantise (16 < 4096 values)."""
    key = jax.random.split(jax.random.key(0), 3)
    return {"w": jax.random.normal(key[0], (4, 64, 128)), "v": jax.random.normal(key[1], (64, 300)),
            "b": jax.random.normal(key[2], (16,))}


def _grads(params: dict[str, jax.Array], step: int) -> dict[str, jax.Array]:
    return jax.tree.map(lambda x: jnp.sin(x * (step + 1.5)) * 10.0 ** (-step), params)


def _spec(x: jax.Array, signed: bool) -> q.Quantized:
    return q.Quantized(np.dtype(x.dtype), x.shape, signed)


def emulated_update(grads: dict, state: optax.ScaleByAdamState, params: dict) -> tuple:
    """Adam on the dequantised moments; the new moments of the large leaves quantised
    (mu with the signed map, nu with the unsigned)."""
    large = {k for k, x in params.items() if x.size >= 4096}

    def widen(tree: dict, signed: bool) -> dict:
        return {k: q.dequantize(x, _spec(params[k], signed)) if k in large else x
                for k, x in tree.items()}

    def narrow(tree: dict, signed: bool) -> dict:
        return {k: q.quantize(x, signed) if k in large else x for k, x in tree.items()}

    adam = state[0]
    inner = (adam._replace(mu=widen(adam.mu, True), nu=widen(adam.nu, False)), *state[1:])
    updates, new = ADAM.update(grads, inner, params)
    adam = new[0]
    return updates, (adam._replace(mu=narrow(adam.mu, True), nu=narrow(adam.nu, False)), *new[1:])


def test_init_keeps_large_moments_packed_in_host_memory() -> None:
    params = _params()
    state = eqx_offload.offloaded(ADAM, host_dtype=jnp.int8).init(params)
    adam = state.inner_state[0]
    for moments in (adam.mu, adam.nu):
        # Rows of codes, 4 a word, then rows of scales (a word per block): 64 scales of
        # a layer in 2 rows of 32 words; 128 scales of "v" in 2 rows of 75 words
        assert (moments["w"].dtype, moments["w"].shape) == (jnp.uint32, (4, 66, 32))
        assert (moments["v"].dtype, moments["v"].shape) == (jnp.uint32, (66, 75))
        assert (moments["b"].dtype, moments["b"].shape) == (jnp.float32, (16,))
        assert {x.sharding.memory_kind for x in moments.values()} == {"pinned_host"}
    assert adam.count.sharding.memory_kind == "device"
    report = eqx_offload.memory_report(state)
    assert report.host_bytes == 2 * (4 * (4 * 66 * 32 + 66 * 75) + 16 * 4)


@pytest.mark.parametrize("group_bytes, jitted", [(None, False), (None, True), ("auto", False),
                                                  ("auto", True), (1 << 14, True)])
def test_each_mode_is_the_emulation_bitwise(group_bytes, jitted) -> None:
    """The whole state at once, `auto`, and streamed (`1 << 14`: the stacked leaf in
    pieces of rows, read from and written into its packed host buffer; it runs compiled
    eagerly too): three steps, updates and packed state bitwise the emulation's (under
    `jit` the jitted emulation's)."""
    params = _params()
    opt = eqx_offload.offloaded(ADAM, host_dtype=jnp.int8, group_bytes=group_bytes)
    state = opt.init(params)
    reference = eqx_offload.to_device(state.inner_state)
    update, emulate = (jax.jit(opt.update), jax.jit(emulated_update)) if jitted else (
        opt.update, emulated_update)
    for step in range(3):
        grads = _grads(params, step)
        updates, state = update(grads, state, params)
        want_updates, reference = emulate(grads, reference, params)
        assert_tree_equal(updates, want_updates)
        assert_tree_equal(jax.device_get(state.inner_state), jax.device_get(reference))
    assert {x.sharding.memory_kind for x in jtu.tree_leaves(state.inner_state[0].mu)} == {
        "pinned_host"}

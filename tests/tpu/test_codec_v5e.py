"""The 8-bit state's codec as XLA:TPU compiles it (for a v5e, without one): the optimized
program of `_decoded` and of `_encoded`, evaluated op by op in NumPy float32, is bitwise
the map and the midpoint count.

XLA:TPU treats float32 arithmetic as real numbers (it rewrote `m * a + m * b` as
`m * (a + b)`): this checks that no such rewrite reaches an op that rounds. (How the
chip runs each op, a fused multiply-add for instance, is left to
`bench/results/tpu-v5e-2026-12-06c/codec_check.py` on the chip.)"""

import re
import warnings
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from eqx_offload._optim import quantize as q


pytestmark = pytest.mark.both  # (libtpu pins its JAX: both environments)

_LINE = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>\S+)\s*=\s*(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]"
                   r"\S*\s+(?P<op>[a-z-]+)\((?P<args>[^)]*)\)(?P<attrs>.*)$")
# A copy between memories (the same values; its start's type is a tuple).
_COPY = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>\S+)\s*=.*\s(?P<op>copy-start|copy-done)"
                   r"\((?P<args>%[^,)\s]+)\)(?P<attrs>.*)$")
_DTYPES = {"f32": np.float32, "s32": np.int32, "u32": np.uint32, "u8": np.uint8,
           "pred": np.bool_}
_BINARY: dict[str, Any] = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
           "maximum": np.maximum, "minimum": np.minimum, "and": np.bitwise_and,
           "or": np.bitwise_or}
_UNARY: dict[str, Any] = {"abs": np.abs, "negate": np.negative, "floor": np.floor, "copy": lambda x: x}
_COMPARE: dict[str, Any] = {"GE": np.greater_equal, "GT": np.greater, "LE": np.less_equal, "LT": np.less,
            "EQ": np.equal, "NE": np.not_equal}


def _computations(text: str) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    lines: list[Any] = []
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%(\S+)\s*\(.*\{\s*$", line)
        if header:
            lines = found.setdefault("ENTRY" if line.startswith("ENTRY") else header.group(1), [])
        elif (match := _LINE.match(re.sub(r", metadata=\{[^}]*\}", "", line))
                       or _COPY.match(line)):
            lines.append(match)
    return found


def _attribute(name: str, match: Any) -> str:
    found = re.search(rf"{name}=%?([\w.-]+)", match["attrs"])
    assert found, match.string
    return found.group(1)


def _evaluate(computations: dict[str, list[Any]], name: str, inputs: list[Any]) -> Any:
    """Run one computation of an HLO module's text on NumPy arrays, op by op."""
    values: dict[str, Any] = {}
    for match in computations[name]:
        op = match["op"]
        if op in ("copy-start", "copy-done"):
            values[match["name"]] = values[match["args"].lstrip("%")]
            continue
        dtype = _DTYPES[match["dtype"]]
        shape = tuple(int(d) for d in match["dims"].split(",") if d)
        args = [values[a.strip().lstrip("%")] for a in match["args"].split(",")
                if a.strip().startswith("%")]
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a NaN's garbage integer: masked later)
            if op == "parameter":
                out = inputs[int(match["args"])]
            elif op == "constant":
                out = np.array(float(match["args"]) if dtype == np.float32
                               else int(match["args"]) if dtype != np.bool_
                               else match["args"] == "true").astype(dtype)
            elif op == "broadcast":
                assert "dimensions={}" in match["attrs"], match.string
                out = np.broadcast_to(args[0], shape)
            elif op == "convert":
                out = args[0].astype(dtype)
            elif op == "bitcast-convert":
                out = args[0].view(dtype)
            elif op == "select":
                out = np.where(*args)
            elif op == "compare":
                out = _COMPARE[_attribute("direction", match)](*args)
            elif op == "fusion":
                out = _evaluate(computations, _attribute("calls", match), args)
            elif op in _BINARY:
                out = _BINARY[op](*args)
            elif op in _UNARY:
                out = _UNARY[op](*args)
            else:
                raise NotImplementedError(f"{op}: {match.string}")
        values[match["name"]] = np.asarray(out, dtype).reshape(shape)
    return values[computations[name][-1]["name"]]


def _compiled(fn: Any, x: np.ndarray, signed: bool, device: Any) -> Any:
    sharding = NamedSharding(Mesh([device], ("x",)), P())
    arg = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    text = jax.jit(fn, static_argnums=1).trace(arg, signed).lower(
        lowering_platforms=("tpu",)).compile().as_text()
    return _evaluate(_computations(text), "ENTRY", [x])


@pytest.mark.parametrize("signed", [True, False])
def test_the_tpu_program_is_the_map_and_the_count(tpu: Any, signed: bool) -> None:
    codes = np.arange(256, dtype=np.int32)
    table = q.dynamic_map(signed)
    decoded = _compiled(q._decoded, codes, signed, tpu)
    np.testing.assert_array_equal(decoded.view(np.uint32), table.view(np.uint32))

    mids = q.midpoints(signed)
    rng = np.random.default_rng(3)
    random = (rng.uniform(-1, 1, 1000) * 10.0 ** rng.uniform(-8, 0, 1000)).astype(np.float32)
    x = np.concatenate([mids, np.nextafter(mids, np.float32(-2)), np.nextafter(mids, np.float32(2)),
                        table, -table, np.array([0.0, -0.0, 1.0, -1.0, np.nan], np.float32),
                        random]).astype(np.float32)
    want = np.where(np.isnan(x), 0, np.searchsorted(mids, x, side="right"))
    np.testing.assert_array_equal(_compiled(q._encoded, x, signed, tpu), want)


_PIECE = (2, 2048, 5632)  # (two layers of a 542M Llama's MLP weight)
_TYPED = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<type>.*?)\s(?P<op>[a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b(?:f32|s32|u32)\[(?P<dims>[\d,]+)\]\{(?P<layout>[\d,]+)")


def test_the_tpu_program_keeps_each_row_along_lanes(tpu: Any) -> None:
    """`quantize` and `dequantize` of a piece of a 542M Llama's moments as XLA:TPU
    compiles them: every array of the piece's values (or of its codes' words) keeps its
    rows along the lanes (the minor axis) and none is copied, so no value is transposed
    and back (reshaped into blocks of 256 or unpacked from interleaved bytes, they were,
    at about four times the device time)."""
    sharding = NamedSharding(Mesh([tpu], ("x",)), P())
    spec = q.Quantized(np.dtype(np.float32), _PIECE, True)
    x = jax.ShapeDtypeStruct(_PIECE, np.float32, sharding=sharding)
    packed = jax.ShapeDtypeStruct(spec.packed, q.CODE_DTYPE, sharding=sharding)
    for fn, arg in ((lambda a: q.quantize(a, True), x), (lambda p: q.dequantize(p, spec), packed)):
        text = jax.jit(fn).trace(arg).lower(lowering_platforms=("tpu",)).compile().as_text()
        typed = [found for line in text.splitlines() if (found := _TYPED.match(line))]
        large = [(found, m) for found in typed for m in _ARRAY.finditer(found["type"])
                 if np.prod([int(d) for d in m["dims"].split(",")]) >= np.prod(_PIECE) // 4]
        assert large
        for found, m in large:
            assert found["op"] != "copy", found.string
            assert m["layout"].split(",")[0] == str(len(m["dims"].split(",")) - 1), found.string

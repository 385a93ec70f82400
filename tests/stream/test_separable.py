"""The walk that proves an update treats the layers of a stacked leaf apart
(`_stream/separable.py`): the rules 8-bit state needs (pads, concatenations, slices,
bitcasts, a table lookup, the CPU's binary search) accept what keeps each layer's
values to its own row and refuse what mixes the rows."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_offload._optim.quantize import _searched
from eqx_offload._stream import separable
from eqx_offload._stream.separable import BLOCK, Mark


pytestmark = pytest.mark.both  # (the primitives JAX binds differ by version)

LAYERS, WIDTH = 3, 8
TABLE = np.linspace(-1.0, 1.0, 16, dtype=np.float32)


def _check(fun: Callable[[Any], Any]) -> None:
    """`separable.check` of `fun` on one stacked leaf `(LAYERS, WIDTH)`, its output
    expected to keep the layer axis."""
    jaxpr = jax.make_jaxpr(fun)(jnp.zeros((LAYERS, WIDTH), jnp.float32))
    separable.check(jaxpr, [Mark(frozenset({BLOCK}), 0)], [Mark(frozenset({BLOCK}))])


APART = {
    "pad of the last axis": lambda x: jnp.pad(x, [(0, 0), (0, 3)]),
    "concatenation along the last axis": lambda x: jnp.concatenate([x, 2 * x], axis=1),
    "slice of the last axis": lambda x: x[:, 2:5],
    "bitcast": lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32),
    "bitcast to bytes and back": lambda x: jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x, jnp.uint8), jnp.float32),
    "table lookup": lambda x: jnp.take(jnp.asarray(TABLE), jnp.clip(x, 0, 15).astype(int)),
    "binary search (8-bit state on the CPU)": lambda x: _searched(x, jnp.asarray(TABLE)),
}
MIXES = {
    "pad of the layer axis": lambda x: jnp.pad(x, [(1, 0), (0, 0)])[:LAYERS],
    "concatenation along the layer axis": lambda x: jnp.concatenate([x, x])[1:LAYERS + 1],
    "slice of the layer axis": lambda x: jnp.concatenate([x[1:], x[:1]]),
    "loop over the layers": lambda x: jax.lax.scan(lambda c, row: (c + row, c), jnp.zeros(
        WIDTH), x)[1],
    "lookup in the layers": lambda x: jnp.take(x.reshape(-1), jnp.arange(LAYERS * WIDTH)[
        ::-1]).reshape(LAYERS, WIDTH),
}


@pytest.mark.parametrize("name", sorted(APART))
def test_accepts_what_keeps_the_layers_apart(name: str) -> None:
    _check(APART[name])


@pytest.mark.parametrize("name", sorted(MIXES))
def test_refuses_what_mixes_the_layers(name: str) -> None:
    with pytest.raises(separable.Mixes):
        _check(MIXES[name])

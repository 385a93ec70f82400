from typing import Any, Union

import numpy as _np

from jax import Array

# As jax.typing.ArrayLike, less NumPy's scalar types: pytype's bundled NumPy stub does not
# declare `numpy.bool_`/`numpy.number` (they resolve to `Any`, and a union with `Any` in
# it accepts everything). NumPy scalars are `Any` for pytype anyway, so they still pass.
ArrayLike = Union[Array, _np.ndarray[Any, Any], bool, int, float, complex]
DTypeLike = Union[str, type[Any], _np.dtype[Any], Any]

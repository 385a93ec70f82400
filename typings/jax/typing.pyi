from typing import Any, Union

import numpy as _np

from jax import Array

ArrayLike = Union[Array, _np.ndarray[Any, Any], _np.bool_, _np.number[Any], bool, int, float, complex]
DTypeLike = Union[str, type[Any], _np.dtype[Any], Any]

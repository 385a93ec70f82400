# What eqx_offload reads of flax (an optional dependency): `nnx_jit` imports `flax.nnx`.
from typing import Any

nnx: Any

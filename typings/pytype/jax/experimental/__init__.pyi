# jax.experimental: only `compute_on` is declared; other names are `Any`.
from typing import Any

from jax.experimental import compute_on as compute_on

def __getattr__(name: str) -> Any: ...

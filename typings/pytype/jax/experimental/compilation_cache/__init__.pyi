# jax.experimental.compilation_cache: the one module the planner reads.
from typing import Any

def __getattr__(name: str) -> Any: ...

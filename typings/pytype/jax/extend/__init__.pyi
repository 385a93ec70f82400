# jax.extend (JAX's semi-internal API for libraries): the modules exist, their names are
# `Any` (a `Jaxpr` is walked structurally; typing it buys little).
from typing import Any

from jax.extend import core as core
from jax.extend import source_info_util as source_info_util

def __getattr__(name: str) -> Any: ...

"""What the library knows of a program it traces itself, that JAX's trace does not
carry: the platforms it is lowered for (`lowering_platforms`) and, in a program of
`filter_make`, the layer of the stacked layers it makes (`layer_being_made`).

Both are set by the library around a trace it starts and read by library functions
the user's code calls inside it, so no argument can carry them:

- `filter_jit` knows its target before it traces: the platform of its arguments'
  devices for a call, the platforms given to `lower_for` and `export`. `jax.jit`
  lowers a traced program for any platform, so `offloaded`'s default update would
  otherwise trace one update for each platform and let `jax.lax.platform_dependent`
  keep one (`_optim/strategies.py`). A trace started elsewhere (`jax.jit`,
  `eqx.filter_jit`, `jax.export` of those) sees `None`: unknown.
- `filter_make` runs the user's `fun`, which calls `stack_layers`; in the program that
  makes layer `i` of the stacks, `stack_layers` makes that layer alone
  (`_models/make.py`). Elsewhere it is `None`: the whole stack.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class Tracing:
    """What the library knows of the program being traced (see the module)."""

    platforms: Optional[tuple[str, ...]] = None
    layer: Optional[Any] = None  # a traced int32 scalar


_TRACING: contextvars.ContextVar[Tracing] = contextvars.ContextVar(
    "eqx_offload_tracing", default=Tracing())


@contextlib.contextmanager
def _tracing(**changes: Any) -> Iterator[None]:
    token = _TRACING.set(dataclasses.replace(_TRACING.get(), **changes))
    try:
        yield
    finally:
        _TRACING.reset(token)


def lowering_for(platforms: Sequence[str]) -> contextlib.AbstractContextManager[None]:
    """Within: programs traced are lowered for `platforms` (JAX's names: `"cpu"`,
    `"cuda"`, `"rocm"`, `"tpu"`; `"gpu"`, a device's platform, stands for CUDA or ROCm)."""
    return _tracing(platforms=tuple(platforms))


def lowering_platforms() -> Optional[tuple[str, ...]]:
    """The platforms the program being traced is lowered for, or `None` if unknown."""
    return _TRACING.get().platforms


def making_layer(layer: Any) -> contextlib.AbstractContextManager[None]:
    """Within: `stack_layers` makes layer `layer` (a traced int32 scalar) alone."""
    return _tracing(layer=layer)


def layer_being_made() -> Optional[Any]:
    """The layer `stack_layers` makes alone, or `None`: the whole stack."""
    return _TRACING.get().layer

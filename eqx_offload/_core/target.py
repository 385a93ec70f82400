"""The platforms a program being traced is lowered for, where the library's own jit
knows them (`lowering_for`, `lowering_platforms`).

`filter_jit` knows its target before it traces: the platform of its arguments' devices
for a call, the platforms given to `lower_for` and `export`. JAX's trace does not carry
it (`jax.jit` lowers a traced program for any platform), so `offloaded`'s default update
would otherwise trace one update for each platform and let `jax.lax.platform_dependent`
keep one (`_optim/strategies.py`). This is the one value that flows into a trace from
outside it; a trace started elsewhere (`jax.jit`, `eqx.filter_jit`, `jax.export` of
those) sees `None`: unknown.
"""

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Optional


_PLATFORMS: contextvars.ContextVar[Optional[tuple[str, ...]]] = contextvars.ContextVar(
    "eqx_offload_lowering_platforms", default=None)


@contextlib.contextmanager
def lowering_for(platforms: Sequence[str]) -> Iterator[None]:
    """Within: programs traced are lowered for `platforms` (JAX's names: `"cpu"`,
    `"cuda"`, `"rocm"`, `"tpu"`; `"gpu"`, a device's platform, stands for CUDA or ROCm)."""
    token = _PLATFORMS.set(tuple(platforms))
    try:
        yield
    finally:
        _PLATFORMS.reset(token)


def lowering_platforms() -> Optional[tuple[str, ...]]:
    """The platforms the program being traced is lowered for, or `None` if unknown."""
    return _PLATFORMS.get()

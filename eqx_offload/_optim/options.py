"""The options of `offloaded`, checked and normalised once (`normalise`) into a frozen
`Options` record."""

import dataclasses
from typing import Any, Literal, Optional, Union

import jax.numpy as jnp
import numpy as np

from .._core.errors import OptionError
from .._core.memory import check_host_kind
from .._core.types import Where
from .codec import AbstractCodec, Cast, Identity
from .quantize import Blockwise8Bit


Compute = Literal["device", "host"]
"""Where `offloaded` runs the inner update: `"device"` (default) or `"host"`."""


@dataclasses.dataclass(frozen=True)
class Options:
    """The normalised options of one `offloaded(...)` transformation."""

    where: Where
    memory_kind: str
    group_bytes: Union[int, str, None]  # None: not streamed; "auto": streamed where it can be
    lookahead: int  # streamed: groups brought to the device ahead of the one updated
    compute: str
    codec: AbstractCodec  # how state is kept in host memory (`host_dtype`'s)
    # The state is of this many stacked layers (`update_in_backward`'s): 8-bit state
    # packs each layer apart (`quantize`). Not an argument of `offloaded`.
    stacked: Optional[int] = None


def normalise(
    where: Where,
    memory_kind: object,
    group_bytes: Any,
    lookahead: Any,
    compute: object,
    host_dtype: object,
) -> Options:
    """Check every option of `offloaded`; raise an `OptionError` (or `MemoryKindError`)
    that names the argument, what was given and the fix."""
    check_host_kind(memory_kind, "memory_kind")
    if compute not in ("device", "host"):
        raise OptionError(
            f"offloaded(compute={compute!r}): compute must be 'device' (default) or 'host'."
        )
    _check_group_bytes(group_bytes, compute)
    if isinstance(lookahead, bool) or not isinstance(lookahead, (int, np.integer)) or lookahead < 0:
        raise OptionError(
            f"offloaded(lookahead={lookahead!r}): lookahead must be an int >= 0 (groups "
            "brought to the device ahead of the one being updated; 0 streams one group "
            "at a time)."
        )
    codec = _codec(host_dtype, compute)
    streaming: Union[int, str, None] = None
    if group_bytes == "auto":
        streaming = "auto"
    elif group_bytes is not None:
        streaming = int(group_bytes)
    return Options(
        where=where,
        memory_kind=str(memory_kind),
        group_bytes=streaming,
        lookahead=int(lookahead),
        compute=str(compute),
        codec=codec,
    )


def _check_group_bytes(group_bytes: Any, compute: object) -> None:
    """`group_bytes` is None, "auto", or an int >= 0 with `compute="device"`."""
    if group_bytes is None or group_bytes == "auto":
        return
    if isinstance(group_bytes, bool) or not isinstance(group_bytes, (int, np.integer)):
        raise OptionError(
            f"offloaded(group_bytes={group_bytes!r}): group_bytes must be an int (bytes "
            "of optimizer state per group), \"auto\" (the default: streamed where the "
            "update allows it) or None (the whole state at once)."
        )
    if group_bytes < 0:
        raise OptionError(f"offloaded(group_bytes={group_bytes}): group_bytes must be >= 0.")
    if compute == "host":
        raise OptionError(
            "offloaded(group_bytes=..., compute='host'): the two modes exclude each "
            "other. With compute='host' the state never reaches the device, so there "
            "is nothing to stream; pass one of them."
        )


def _codec(host_dtype: object, compute: object) -> AbstractCodec:
    """The codec `host_dtype` names, with `compute="device"`: `None`, the identity; a
    floating dtype, a cast to it; `jnp.int8` or `jnp.uint8` (or their names), 8-bit
    block-wise quantised moments; a codec, itself."""
    if host_dtype is None:
        return Identity()
    codec: Optional[AbstractCodec] = host_dtype if isinstance(host_dtype, AbstractCodec) else None
    if codec is None:
        try:
            dtype = np.dtype(host_dtype)  # type: ignore[call-overload]  # checked just below
        except TypeError:
            dtype = None
        if dtype is not None and dtype in (np.int8, np.uint8):
            codec = Blockwise8Bit()
        elif dtype is not None and jnp.issubdtype(dtype, jnp.floating):
            codec = Cast(dtype)
        else:
            raise OptionError(
                f"offloaded(host_dtype={host_dtype!r}): host_dtype must be a floating "
                "dtype such as jnp.bfloat16, jnp.int8 for 8-bit block-wise quantised "
                "moments, or None to keep each leaf's dtype."
            )
    if compute == "host":
        raise OptionError(
            "offloaded(host_dtype=..., compute='host'): with compute='host' the state "
            "never crosses to the device, so there is nothing to narrow; pass one of "
            "them."
        )
    return codec

"""The options of `offloaded`, checked and normalised once, and the two transfers they
imply: state leaves to the device for the update (`fetch`), and back to host (`store`).

Every update strategy (`_optax`'s default, `_stream`, `_host_compute`) receives an
`Options` and moves state only through `fetch` and `store`, so `host_dtype` (narrow on
the way to host, widen on the way back) holds in every mode.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._errors import OptionError
from ._memory import check_host_kind
from ._move import move
from ._types import Where
from ._where import leaf_mask


_T = TypeVar("_T")


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
    host_dtype: Optional[np.dtype]  # None: state keeps its dtype on host

    def fetch(self, leaves: Sequence[Any], init_dtypes: Sequence[Any]) -> list[Any]:
        """Leaves to the device's default memory, each widened back to the dtype
        `inner.init` gives it (`init_dtypes`) if `store` narrowed it on host."""
        moved = move(list(leaves), True, None, "to_device")
        return [self.widen(x, d) for x, d in zip(moved, init_dtypes, strict=True)]

    def widen(self, leaf: Any, init_dtype: Any) -> Any:
        """`leaf` back in `init_dtype` if `narrow` made it `host_dtype` from that."""
        dtype = self.widened_dtype(getattr(leaf, "dtype", None), init_dtype)
        return leaf if dtype == getattr(leaf, "dtype", None) else leaf.astype(dtype)

    def widened_dtype(self, dtype: Any, init_dtype: Any) -> Any:
        """The dtype `widen` gives a leaf of `dtype` whose `inner.init` dtype is
        `init_dtype`."""
        if (
            self.host_dtype is None
            or init_dtype is None
            or dtype != self.host_dtype
            or not jnp.issubdtype(init_dtype, jnp.floating)
            or np.dtype(init_dtype).itemsize <= self.host_dtype.itemsize
        ):
            return dtype
        return init_dtype

    def store(self, tree: _T, where: Where = True, memory_kind: Optional[str] = None) -> _T:
        """The leaves of `tree` that `where` selects, narrowed to `host_dtype` (where
        that is narrower), then sent to host (`memory_kind`, default the option's)."""
        if self.host_dtype is not None:
            leaves, treedef = jtu.tree_flatten(tree)
            mask = leaf_mask(tree, where)
            tree = jtu.tree_unflatten(treedef, [
                self.narrow(x) if m else x for x, m in zip(leaves, mask, strict=True)])
        return move(tree, where, memory_kind or self.memory_kind, "memory_kind")

    def narrow(self, leaf: Any) -> Any:
        """`leaf` in `host_dtype` if it is a real floating array wider than that."""
        if (
            self.host_dtype is None
            or not isinstance(leaf, jax.Array)
            or not jnp.issubdtype(leaf.dtype, jnp.floating)
            or leaf.dtype.itemsize <= self.host_dtype.itemsize
        ):
            return leaf
        return leaf.astype(self.host_dtype)


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
    if group_bytes is not None and group_bytes != "auto":
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
    if isinstance(lookahead, bool) or not isinstance(lookahead, (int, np.integer)) or lookahead < 0:
        raise OptionError(
            f"offloaded(lookahead={lookahead!r}): lookahead must be an int >= 0 (groups "
            "brought to the device ahead of the one being updated; 0 streams one group "
            "at a time)."
        )
    dtype = None
    if host_dtype is not None:
        try:
            dtype = np.dtype(host_dtype)  # type: ignore[call-overload]  # checked just below
        except TypeError:
            dtype = None
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise OptionError(
                f"offloaded(host_dtype={host_dtype!r}): host_dtype must be a floating "
                "dtype such as jnp.bfloat16 (or None to keep each leaf's dtype)."
            )
        if compute == "host":
            raise OptionError(
                "offloaded(host_dtype=..., compute='host'): with compute='host' the state "
                "never crosses to the device, so there is nothing to narrow; pass one of "
                "them."
            )
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
        host_dtype=dtype,
    )

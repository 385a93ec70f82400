"""What the engine asks of its caller: how a state leaf crosses between host and
device memory. The caller (`offloaded`'s layout, with its `host_dtype` and shardings)
knows; the engine only orders the crossings."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Transfers:
    """How the streamed update moves state, as its caller lays the state out.

    **Fields:**

    - `fetch`: `fetch(leaves, init_dtypes)`: leaves to the device, widened back to
        `init_dtypes` where storing narrowed them.
    - `narrow`: `narrow(leaves, init_dtypes)`: new state leaves, on the device, as they
        are stored (`init_dtypes`: each leaf's entry of the layout's, which says which
        leaves 8-bit state keeps quantised).
    - `store`: `store(leaves)`: leaves to (pinned) host memory, narrowed.
    - `computes_in`: `computes_in(dtype, init_dtype)`: the dtype the update computes a
        leaf stored in `dtype` in (what `fetch` gives it).
    - `lookahead`: how many groups come to the device ahead of the one updated.
    """

    fetch: Callable[[Sequence[Any], Sequence[Any]], list[Any]]
    narrow: Callable[[Sequence[Any], Sequence[Any]], list[Any]]
    store: Callable[[Sequence[Any]], list[Any]]
    computes_in: Callable[[Any, Any], Any]
    lookahead: int

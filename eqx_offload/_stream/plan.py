"""The streamed update's plan as users read it (`StreamPlan`, from
`eqx_offload.stream.stream_plan`), and the group size of `group_bytes="auto"`."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """How `offloaded(inner, group_bytes=N)` streams a state through the device.

    **Fields:**

    - `groups`: for each group, in the order the update runs them, the paths (as in
        `eqx_offload.pattern`, relative to the inner state) of its state leaves; a
        piece of a stacked leaf split by layers names its rows,
        `"0/mu/layers/weight[0:2]"`.
    - `group_nbytes`: the bytes of state each group brings to the device (as the
        update computes on it: after widening, with `host_dtype`).
    - `prologue`: offloaded 0-d leaves (e.g. a step counter, when `where` selects it);
        every group reads them, so they come to the device once, before the first group.
    - `resident`: state leaves that stay on the device (not selected by `where`).

    The state's share of peak device memory during the update is about
    `(lookahead + 2) * max_group_nbytes` plus the prologue (one group computing, the
    next `lookahead` arriving, the previous one leaving), instead of the whole
    offloaded state.
    """

    groups: tuple[tuple[str, ...], ...]
    group_nbytes: tuple[int, ...]
    prologue: tuple[str, ...]
    resident: tuple[str, ...]

    @property
    def max_group_nbytes(self) -> int:
        """The bytes of the largest group (0 if nothing is streamed)."""
        return max(self.group_nbytes, default=0)

    @property
    def total_nbytes(self) -> int:
        """The bytes of all groups together: what the default update brings at once."""
        return sum(self.group_nbytes)


AUTO_GROUPS = 16
"""`group_bytes="auto"`: the streamed state is cut into about this many groups..."""
AUTO_MAX_GROUP_BYTES = 256 << 20
"""... of at most this many bytes (a bound on the state's share of the update's peak).
There is no lower bound: a state brought to the device whole needs room for itself and
its new value at once, which in the GPU plan of a small MLP is more than the step
without offload holds (1.09x; streamed in 16 groups, 0.66x)."""


def auto_group_bytes(total_bytes: int) -> int:
    """The group size of `group_bytes="auto"` for `total_bytes` of streamed state."""
    return min(AUTO_MAX_GROUP_BYTES, total_bytes // AUTO_GROUPS)

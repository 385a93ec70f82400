"""`memory_report`: where the bytes of a pytree live."""

import dataclasses
from typing import Any, Optional

import equinox as eqx
import jax
import jax.tree_util as jtu

from ._core.leaves import format_bytes, is_traced, nbytes, path_to_str, shown
from ._core.memory import (HOST_LIMIT_VARIABLE, HOST_MEMORY_KINDS, host_pool_limit, platform_of,
                      pooled_bytes)
from ._core.placement import memory_kind_of


@dataclasses.dataclass(frozen=True)
class LeafMemory:
    """One array leaf of a `MemoryReport`."""

    path: str
    memory_kind: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of a pytree per memory kind and per leaf path.

    **Fields:**

    - `by_kind`: bytes per memory kind (`"device"`, `"pinned_host"`, ...).
    - `leaves`: one `LeafMemory` per array leaf, in tree order.

    `device_bytes` sums the device kinds and `host_bytes` the JAX host kinds
    (`"pinned_host"`, `"unpinned_host"`); NumPy arrays count under `"numpy"`, traced
    PRNG keys (whose memory JAX's type does not tell) under `"unknown"`, and
    `jax.ShapeDtypeStruct`s without a sharding under `"unplaced"`, and arrays a donating
    call consumed (deleted: they hold no memory) under `"deleted"` with 0 bytes, in
    neither.
    Sizes are global (a sharded array counts once, at its full size). `str(report)` is
    a plain-text table; with `rich` installed, `rich.print(report)` draws one.

    - `host_pool_bytes`: the `pinned_host` bytes this process holds for the tree, one
        shard per device (a replicated leaf counts once per device): what XLA's GPU
        client allocates from its pinned host pool.
    - `host_pool_limit`: that pool's cap where one applies (CUDA and ROCm:
        `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`, 64 GiB by default), else `None`; the
        table's last line shows the two.
    """

    by_kind: dict[str, int]
    leaves: tuple[LeafMemory, ...]
    host_pool_bytes: int = 0
    host_pool_limit: Optional[int] = None

    @property
    def device_bytes(self) -> int:
        return sum(
            n for k, n in self.by_kind.items() if k not in HOST_MEMORY_KINDS + _UNPLACED
        )

    @property
    def host_bytes(self) -> int:
        return sum(n for k, n in self.by_kind.items() if k in HOST_MEMORY_KINDS)

    @property
    def total_bytes(self) -> int:
        return sum(self.by_kind.values())

    def _rows(self) -> tuple[list[str], list[list[str]], list[str]]:
        header = ["path", "shape", "dtype", "memory kind", "bytes"]
        rows = [
            [shown(leaf.path), str(list(leaf.shape)), leaf.dtype, leaf.memory_kind,
             format_bytes(leaf.nbytes)]
            for leaf in self.leaves
        ]
        kinds = ", ".join(f"{k}: {format_bytes(n)}" for k, n in sorted(self.by_kind.items()))
        footer = ["total", "", "", kinds, format_bytes(self.total_bytes)]
        return header, rows, footer

    def __str__(self) -> str:
        header, rows, footer = self._rows()
        table = [header, *rows, footer]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]

        def line(row: list[str]) -> str:
            cells = [c.rjust(w) if i == len(row) - 1 else c.ljust(w)
                     for i, (c, w) in enumerate(zip(row, widths, strict=True))]
            return "  ".join(cells).rstrip()

        rule = "  ".join("-" * w for w in widths)
        return "\n".join(
            ["memory report", line(header), rule, *map(line, rows), rule, line(footer),
             *self._pool_lines()]
        )

    def _pool_lines(self) -> list[str]:
        if self.host_pool_limit is None:
            return []
        share = self.host_pool_bytes / self.host_pool_limit if self.host_pool_limit else 1.0
        return [f"pinned host pool: {format_bytes(self.host_pool_bytes)} of the "
                f"{format_bytes(self.host_pool_limit)} cap ({share:.1%}; "
                f"{HOST_LIMIT_VARIABLE})"]

    def __rich__(self) -> Any:
        from rich.table import Table  # optional: only for `rich.print(report)`

        header, rows, footer = self._rows()
        table = Table(title="memory report", show_footer=True)
        for name, foot in zip(header, footer, strict=True):
            table.add_column(name, footer=foot, justify="right" if name == "bytes" else "left")
        for row in rows:
            table.add_row(*row)
        for line in self._pool_lines():
            table.caption = line
        return table


_UNPLACED = ("numpy", "unknown", "unplaced", "deleted")


def _kind_of(leaf: Any) -> str:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        # An abstract leaf (`eqx.filter_eval_shape`, `abstract_init`): the memory kind
        # its sharding names, or "unplaced" where it has no sharding.
        sharding = leaf.sharding
        if sharding is None:
            return "unplaced"
        return str(getattr(sharding, "memory_kind", None) or "device")
    kind = memory_kind_of(leaf)
    if kind is not None:
        return kind
    return "unknown" if isinstance(leaf, jax.Array) else "numpy"


def _counted(leaf: Any) -> bool:
    return eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


def memory_report(tree: Any) -> MemoryReport:
    """Bytes of a pytree per memory kind and per leaf path.

    **Arguments:**

    - `tree`: any pytree; its array leaves are counted (NumPy arrays under the kind
        `"numpy"`), and so are the `jax.ShapeDtypeStruct`s of an abstract tree (such as
        `eqx.filter_eval_shape` makes) under their sharding's memory kind, or
        `"unplaced"` without a sharding; everything else is ignored.

    **Returns:**

    A `MemoryReport`; print it for a table.

    !!! Example

        ```python
        import jax.numpy as jnp
        import eqx_offload

        tree = eqx_offload.to_host({"mu": jnp.ones((256, 256)), "count": jnp.zeros(())})
        report = eqx_offload.memory_report(tree)
        assert report.host_bytes == 256 * 256 * 4 + 4
        print(report)
        ```
    """
    leaves = []
    by_kind: dict[str, int] = {}
    concrete = [x for x in jtu.tree_leaves(tree)
                if isinstance(x, jax.Array) and not is_traced(x) and not x.is_deleted()]
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        if not _counted(leaf):  # (tracers are `jax.Array`s too)
            continue
        deleted = isinstance(leaf, jax.Array) and not is_traced(leaf) and leaf.is_deleted()
        kind = "deleted" if deleted else _kind_of(leaf)
        size = 0 if deleted else nbytes(leaf)
        by_kind[kind] = by_kind.get(kind, 0) + size
        leaves.append(LeafMemory(path_to_str(path), kind, size, tuple(leaf.shape), str(leaf.dtype)))
    limit = host_pool_limit(platform_of(concrete)) if concrete else None
    pooled = sum(map(pooled_bytes, concrete))
    return MemoryReport(by_kind, tuple(leaves), pooled, limit)

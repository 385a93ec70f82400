"""`memory_report`: where the bytes of a pytree live."""

import dataclasses
import io
from typing import Any, Union

import equinox as eqx
import jax
import jax.tree_util as jtu

from ._where import is_traced, nbytes, path_to_str


_HOST_KINDS = ("pinned_host", "unpinned_host")


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
    (`"pinned_host"`, `"unpinned_host"`); NumPy arrays count under `"numpy"`, in neither.
    Sizes are global (a sharded array counts once, at its full size). `str(report)` is
    a table.
    """

    by_kind: dict[str, int]
    leaves: tuple[LeafMemory, ...]

    @property
    def device_bytes(self) -> int:
        return sum(n for k, n in self.by_kind.items() if k not in _HOST_KINDS + ("numpy",))

    @property
    def host_bytes(self) -> int:
        return sum(n for k, n in self.by_kind.items() if k in _HOST_KINDS)

    @property
    def total_bytes(self) -> int:
        return sum(self.by_kind.values())

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table(title="memory report", show_footer=True)
        table.add_column("path", footer="total")
        table.add_column("shape")
        table.add_column("dtype")
        table.add_column("memory kind", footer=", ".join(
            f"{k}: {format_bytes(n)}" for k, n in sorted(self.by_kind.items())))
        table.add_column("bytes", justify="right", footer=format_bytes(self.total_bytes))
        for leaf in self.leaves:
            table.add_row(leaf.path or "<root>", str(list(leaf.shape)), leaf.dtype,
                          leaf.memory_kind, format_bytes(leaf.nbytes))
        return table

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=120, record=True, file=io.StringIO())
        console.print(self)
        return console.export_text().rstrip("\n")


def format_bytes(n: Union[int, float]) -> str:
    """`1536` -> `"1.5 KiB"`. (`int` spelled out: beartype, unlike mypy, does not
    accept an `int` for `float`.)"""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _kind_of(leaf: Any) -> str:
    if is_traced(leaf):
        space = jax.typeof(leaf).memory_space
        return "pinned_host" if space == jax.memory.Space.Host else "device"
    if isinstance(leaf, jax.Array):
        kind = leaf.sharding.memory_kind
        return kind if kind is not None else "device"
    return "numpy"


def memory_report(tree: Any) -> MemoryReport:
    """Bytes of a pytree per memory kind and per leaf path.

    **Arguments:**

    - `tree`: any pytree; its array leaves are counted (NumPy arrays under the kind
        `"numpy"`), everything else is ignored.

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
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        if not eqx.is_array(leaf):  # tracers are `jax.Array`s too
            continue
        kind = _kind_of(leaf)
        size = nbytes(leaf)
        by_kind[kind] = by_kind.get(kind, 0) + size
        leaves.append(LeafMemory(path_to_str(path), kind, size, tuple(leaf.shape), str(leaf.dtype)))
    return MemoryReport(by_kind, tuple(leaves))

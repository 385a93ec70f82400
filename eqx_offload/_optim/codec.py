"""How `offloaded` keeps its state in host memory: a codec, chosen once from
`host_dtype` when the options are normalised (`options.normalise`).

A codec says, for each leaf of the state `inner.init` makes, how it is kept (`specs`: a
spec per leaf, or `None` for a leaf kept as it is), and then, given that spec, how a
value on the device becomes its stored form (`narrow`), how the stored form becomes the
value the update computes on (`widen`), and what the stored form is (`stored`,
`computes_in`). The layout (`layout`) holds the specs (`specs_of`: master weights are
never narrowed, whatever the codec) and applies the codec in both transfers; nothing
else knows the format.

- `Identity` (`host_dtype=None`): every leaf as it is.
- `Cast` (a floating `host_dtype`, e.g. `jnp.bfloat16`): floating leaves wider than it
  cast to it on the way to host and back to their own dtype on the way to the device.
- `quantize.Blockwise8Bit` (`host_dtype=jnp.int8`): Adam's moments 8-bit block-wise
  quantised.

A new format is one subclass of `AbstractCodec` (its module and its tests); `offloaded`
takes an instance as its `host_dtype`."""

import abc
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.typing import ArrayLike

from .._core.leaves import KeyPath


KEPT_FIELDS = frozenset({"master"})
"""State fields whose leaves no codec narrows: master weights (the `master` of
`master_weights`' `MasterState`), which keep the dtype they were made in (its
`master_dtype`, float32 by default). A narrowed master is `master_dtype`'s choice."""


# pytype: disable=ignored-abstractmethod,bad-return-type  # (eqx.Module's abstract methods)
class AbstractCodec(eqx.Module):
    """How state leaves are kept in host memory (`offloaded(..., host_dtype=...)`).

    A spec (any hashable value a codec chooses) describes how one leaf is kept; the
    layout passes each leaf's spec back to `narrow`, `widen` and `computes_in`, never
    `None` (a leaf whose spec is `None` is kept as it is). `narrow` and `widen` may get
    a leaf's rows along its leading axes (the streamed update moves pieces of a leaf),
    so a stored form whose leading axes keep their meaning streams by rows."""

    fences_init: ClassVar[bool] = False
    """Whether `init`'s state (constants: zeros) is fenced before it is narrowed, so that
    XLA narrows it when the program runs rather than folding a costly `narrow` over
    every value as it compiles."""

    @abc.abstractmethod
    def specs(self, paths: Sequence[KeyPath], leaves: Sequence[Any],
              layers: Optional[int]) -> list[Optional[Hashable]]:
        """How each of `leaves` (flat leaves of the state `inner.init` makes, as arrays
        or `jax.ShapeDtypeStruct`s, at these key `paths`) is kept, `None` for a leaf kept
        as it is. `layers`: the leaves are of that many stacked layers
        (`update_in_backward`'s), or of one layer's slice of them."""

    @abc.abstractmethod
    def narrow(self, leaf: ArrayLike, spec: Hashable) -> ArrayLike:
        """`leaf` (a value the update made, on the device) in its stored form; a leaf
        that is stored already, or that this codec leaves alone, as it is."""

    @abc.abstractmethod
    def widen(self, leaf: ArrayLike, spec: Hashable) -> ArrayLike:
        """`leaf` in its stored form as the update computes on it; any other leaf as it
        is."""

    @abc.abstractmethod
    def computes_in(self, dtype: Any, spec: Hashable) -> Any:
        """What `widen` makes of a whole leaf of `dtype` (a NumPy or extended dtype, as
        of a PRNG key): its dtype, or a `jax.ShapeDtypeStruct` where its shape changes
        too."""

    @abc.abstractmethod
    def stored(self, spec: Hashable) -> jax.ShapeDtypeStruct:
        """The stored form of a whole leaf of `spec` (what `init` leaves in host memory)."""


class Identity(AbstractCodec):
    """Every leaf kept as it is (`host_dtype=None`)."""

    def specs(self, paths: Sequence[KeyPath], leaves: Sequence[Any],
              layers: Optional[int]) -> list[Optional[Hashable]]:
        return [None] * len(leaves)

    def narrow(self, leaf: ArrayLike, spec: Hashable) -> ArrayLike:
        return leaf

    def widen(self, leaf: ArrayLike, spec: Hashable) -> ArrayLike:
        return leaf

    def computes_in(self, dtype: Any, spec: Hashable) -> Any:
        return dtype

    def stored(self, spec: Hashable) -> jax.ShapeDtypeStruct:
        assert isinstance(spec, jax.ShapeDtypeStruct)
        return spec


class Cast(AbstractCodec):
    """Floating leaves wider than `dtype` kept in `dtype` (`host_dtype=jnp.bfloat16`),
    cast back to the dtype `inner.init` gives them; every other leaf as it is. A leaf's
    spec: its `jax.ShapeDtypeStruct` as `inner.init` makes it."""

    dtype: np.dtype

    def specs(self, paths: Sequence[KeyPath], leaves: Sequence[Any],
              layers: Optional[int]) -> list[Optional[Hashable]]:
        return [jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
                if hasattr(x, "dtype") and hasattr(x, "shape") else None for x in leaves]

    def narrow(self, leaf: ArrayLike, spec: Hashable) -> ArrayLike:
        if isinstance(leaf, jax.Array) and self._narrows(leaf.dtype):
            return leaf.astype(self.dtype)
        return leaf

    def widen(self, leaf: ArrayLike, spec: Hashable) -> ArrayLike:
        assert isinstance(leaf, (jax.Array, np.ndarray, np.generic))  # (it has a spec)
        wide = self.computes_in(leaf.dtype, spec)  # pytype: disable=attribute-error  # (an array: the assert)
        return leaf if wide == leaf.dtype else leaf.astype(wide)  # pytype: disable=attribute-error  # (as above)

    def computes_in(self, dtype: Any, spec: Hashable) -> Any:
        assert isinstance(spec, jax.ShapeDtypeStruct)
        return spec.dtype if dtype == self.dtype and self._narrows(spec.dtype) else dtype

    def stored(self, spec: Hashable) -> jax.ShapeDtypeStruct:
        assert isinstance(spec, jax.ShapeDtypeStruct)
        return jax.ShapeDtypeStruct(spec.shape,
                                    self.dtype if self._narrows(spec.dtype) else spec.dtype)

    def _narrows(self, dtype: Any) -> bool:
        """Whether a leaf of `dtype` is kept in `self.dtype`: floating, and wider."""
        return bool(jnp.issubdtype(dtype, jnp.floating)
                    and np.dtype(dtype).itemsize > self.dtype.itemsize)


def specs_of(codec: AbstractCodec, treedef: Any, leaves: Sequence[Any],
             layers: Optional[int]) -> list[Optional[Hashable]]:
    """`codec.specs` of `leaves` (flat, of a tree of structure `treedef`), with `None`
    for every leaf under a `KEPT_FIELDS` field (master weights)."""
    placeholders = jtu.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    paths = [p for p, _ in jtu.tree_flatten_with_path(placeholders)[0]]
    specs = codec.specs(paths, leaves, layers)
    return [None if _kept(p) else s for p, s in zip(paths, specs, strict=True)]


def _kept(path: KeyPath) -> bool:
    return any(getattr(key, "name", None) in KEPT_FIELDS for key in path)

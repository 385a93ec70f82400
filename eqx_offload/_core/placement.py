"""Where a leaf is: the one module that answers placement questions (where a move
sends a leaf, `destination`, is the mover's own: `move`).

- `memory_kind_of`: the memory kind of a leaf, concrete or traced (PRNG keys included).
- `packed_vector` / `stacked_packed_vector`: the host arrays a TPU cannot copy a row of.
- `input_shardings` / `output_shardings`: the concrete shardings, memory kinds
  included, that `filter_jit` compiles for and `abstract_init` restores into.
- `retype_hosts` / `typed_sharding`: the one workaround for JAX typing some host arrays
  as device memory.

Every other module asks here: `move`, `jit`, `report`, `stream`, `checkpoint` and
`offloaded`.
"""

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import jax
from jax.core import Tracer
import numpy as np

from .compat import copy, is_single_device_sharding, single_device_sharding
from .memory import default_device, HOST_MEMORY_KINDS
from .types import Device


# ----------------------------------------------------------------------------------------
# Where a leaf is


def _is_prng_key(leaf: Any) -> bool:
    return bool(jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def memory_kind_of(leaf: Any) -> Optional[str]:
    """The memory kind of a JAX array leaf: `"device"`, `"pinned_host"` or
    `"unpinned_host"`; `None` for anything else (NumPy arrays and Python scalars are
    not placed yet) and where JAX's type cannot say.

    A traced leaf is in host memory if its type says so; under `jit` that is
    `"pinned_host"`, the only host memory JAX reaches there. JAX (0.10) types a traced
    PRNG key array as device memory wherever it is, so for those the answer is `None`.
    """
    if isinstance(leaf, Tracer):
        if _is_prng_key(leaf):
            return None
        space = jax.typeof(leaf).memory_space
        return "pinned_host" if space == jax.memory.Space.Host else "device"
    if isinstance(leaf, jax.Array):
        kind = leaf.sharding.memory_kind
        return "device" if kind is None else str(kind)
    return None


def is_host(leaf: Any) -> bool:
    """Whether a leaf is a JAX array in host memory (see `memory_kind_of`)."""
    return memory_kind_of(leaf) in HOST_MEMORY_KINDS


def any_on_host(leaves: Iterable[Any]) -> bool:
    """Whether any of `leaves` is a JAX array in host memory (`is_host`)."""
    return any(memory_kind_of(x) in HOST_MEMORY_KINDS for x in leaves)


# ----------------------------------------------------------------------------------------
# What a TPU cannot copy a row of, and a device's own memory


def packed_vector(aval: Any) -> bool:
    """Whether `aval` (an array or its type) is a vector or a scalar of a dtype under 32
    bits (bf16, fp8, int8): one row of a stacked array of such values cannot be copied
    between a TPU and host memory (a TPU packs 2 or 4 of them into one 32-bit word
    along the second-to-last axis; "On a TPU" in `docs/models.md`)."""
    return len(aval.shape) <= 1 and aval.dtype.itemsize < 4


def stacked_packed_vector(leaf: Any) -> bool:
    """Whether `leaf` is a stacked host array whose layers are `packed_vector`s: one
    layer of it cannot be sliced out of (or written into) host memory on a TPU, so it
    moves whole."""
    return is_host(leaf) and packed_vector(jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype))


def default_kind(device: Device) -> str:
    """The memory kind arrays land in on `device` when no kind is asked for."""
    return str(device.default_memory().kind)


# ----------------------------------------------------------------------------------------
# JAX's host mistyping, and its one workaround
#
# JAX (0.10) gives an array assembled from shards with a `SingleDeviceSharding`
# (`jax.make_array_from_single_device_arrays`, `jax.make_array_from_callback`; orbax
# restores that way) the type of device memory whatever the sharding's memory kind.
# Traced as it is, a host-resident state would be computed on as if it were in device
# memory. Two faces of one fix: a sharding that carries its memory kind into the type
# (for restores), and a typed copy of an array that already exists (for `filter_jit`).


def typed_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """`sharding`, or for one device in host memory the same placement as a
    `NamedSharding` over a one-device mesh (which carries its memory kind into the
    type of the arrays assembled with it)."""
    if (
        is_single_device_sharding(sharding)
        and sharding.memory_kind in HOST_MEMORY_KINDS
    ):
        (device,) = sharding.device_set
        mesh = jax.sharding.Mesh(
            np.array([device]), ("device",), axis_types=(jax.sharding.AxisType.Auto,)
        )
        return jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(), memory_kind=sharding.memory_kind
        )
    return sharding


def retype_hosts(leaves: list[Any]) -> dict[int, jax.Array]:
    """Each `pinned_host` array of `leaves` whose JAX type says device memory replaced
    (in place) by a correctly typed copy (host to host, same sharding). Returns index ->
    the mistyped original."""
    retyped = {i: x for i, x in enumerate(leaves)
               if isinstance(x, jax.Array) and not isinstance(x, Tracer)
               and x.sharding.memory_kind == "pinned_host"
               and jax.typeof(x).memory_space != jax.memory.Space.Host}
    for i, x in retyped.items():
        leaves[i] = copy(x)
    return retyped


# ----------------------------------------------------------------------------------------
# Shardings for a compiled program


def is_committed(x: Any) -> bool:
    """A committed `jax.Array`, or a `jax.ShapeDtypeStruct` that carries a sharding."""
    if isinstance(x, jax.Array):
        return bool(x.committed)
    return isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None


def input_shardings(leaves: Sequence[Any]) -> list[jax.sharding.Sharding]:
    """The sharding each argument leaf is compiled for.

    A committed `jax.Array` keeps its own. An uncommitted one (e.g. `jnp.ones(3)`) or a
    NumPy array goes where `jax.jit` would put it: replicated over the mesh of the
    committed arguments, or onto their one device, in its own memory kind (a sharded
    model called with a fresh batch must not fail with "incompatible devices")."""
    committed = [x.sharding for x in leaves if is_committed(x)]
    meshes = [s.mesh for s in committed if isinstance(s, jax.sharding.NamedSharding)]
    devices = {d for s in committed for d in s.device_set}
    result: list[jax.sharding.Sharding] = []
    for leaf in leaves:
        if is_committed(leaf) or (isinstance(leaf, jax.Array) and not committed):
            result.append(leaf.sharding)
            continue
        kind = leaf.sharding.memory_kind if isinstance(leaf, jax.Array) else None
        if meshes:
            result.append(jax.sharding.NamedSharding(
                meshes[0], jax.sharding.PartitionSpec(), memory_kind=kind))
        elif len(devices) == 1:
            result.append(single_device_sharding(next(iter(devices)), memory_kind=kind))
        elif isinstance(leaf, jax.Array):
            result.append(leaf.sharding)
        else:
            result.append(single_device_sharding(default_device()))
    return result


def _common_suffix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """How many parts `a` and `b` end with alike."""
    pairs = enumerate(zip(reversed(a), reversed(b)))
    return next((n for n, (x, y) in pairs if x != y), min(len(a), len(b)))


def output_shardings(
    out_avals: Sequence[Any],
    out_paths: Sequence[tuple[str, ...]],
    in_avals: Sequence[Any],
    in_paths: Sequence[tuple[str, ...]],
    in_shardings: Sequence[jax.sharding.Sharding],
    constrained: Optional[Sequence[Optional[jax.sharding.Sharding]]] = None,
) -> list[jax.sharding.Sharding]:
    """A concrete sharding with the right memory kind for every output.

    The memory kind comes from the traced program (`aval.memory_space`). The layout, in
    order of preference: the sharding the program constrains the output to
    (`constrained`: `jax.lax.with_sharding_constraint`, `eqx.filter_shard`); the
    sharding an explicit-axes mesh gives the output; the
    sharding of an input of the same shape (a training step returns new params and
    state shaped like the old ones) -- of several, the one whose path in the arguments
    ends like the output's path in the result (`(model, state)` in, `(model, state)`
    out), then one of the same dtype; replicated over the inputs' mesh; the default
    device. Paths are `paths_parts` of the argument tuple / the result.

    (An `Auto`-axes mesh gives every traced value an all-`None` spec, so only an
    explicit-axes mesh's spec is trusted: trusting the other would replicate every
    model-parallel output.)
    """
    meshes = [s.mesh for s in in_shardings if isinstance(s, jax.sharding.NamedSharding)]
    mesh = meshes[0] if meshes else None
    if mesh is not None:
        device = np.asarray(mesh.devices).flat[0]
    else:
        devices = [d for s in in_shardings for d in s.device_set]
        device = devices[0] if devices else default_device()
    by_shape: dict[Any, list[tuple[Any, tuple[str, ...], jax.sharding.Sharding]]] = {}
    for aval, path, in_sharding in zip(in_avals, in_paths, in_shardings, strict=True):
        by_shape.setdefault(aval.shape, []).append((aval.dtype, path, in_sharding))
    if constrained is None:
        constrained = [None] * len(out_avals)
    on_device = default_kind(device)
    return [_output_sharding(aval, out_path, constraint, "pinned_host"
                             if aval.memory_space == jax.memory.Space.Host else on_device,
                             by_shape, mesh, device)
            for aval, out_path, constraint in zip(out_avals, out_paths, constrained, strict=True)]


def _output_sharding(aval: Any, out_path: tuple[str, ...],
                     constraint: Optional[jax.sharding.Sharding], kind: str,
                     by_shape: dict[Any, list[tuple[Any, tuple[str, ...], jax.sharding.Sharding]]],
                     mesh: Any, device: Device) -> jax.sharding.Sharding:
    """One output's sharding, in `output_shardings`' order of preference."""
    abstract = getattr(aval, "sharding", None)
    candidates = by_shape.get(aval.shape, [])
    like_input = None
    if candidates:
        _, _, best = max(
            candidates,  # of equal keys `max` keeps the first: the earliest input
            key=lambda c: (_common_suffix(c[1], out_path), c[0] == aval.dtype),
        )
        like_input = best.with_memory_kind(kind)
    if isinstance(constraint, jax.sharding.NamedSharding) and isinstance(
        constraint.mesh, jax.sharding.Mesh
    ):
        sharding: jax.sharding.Sharding = constraint.with_memory_kind(kind)
        if like_input is not None and like_input.is_equivalent_to(sharding, aval.ndim):
            sharding = like_input
    elif (
        mesh is not None
        and isinstance(abstract, jax.sharding.NamedSharding)
        and not abstract.mesh.empty
        and abstract.mesh.axis_names == mesh.axis_names
        and jax.sharding.AxisType.Explicit in abstract.mesh.axis_types
    ):
        sharding = jax.sharding.NamedSharding(mesh, abstract.spec, memory_kind=kind)
        # `P()` and `P(None,)` mean the same but hash apart: keep the input's own
        # spelling so the next call hits the cache.
        if like_input is not None and like_input.is_equivalent_to(sharding, aval.ndim):
            sharding = like_input
    elif like_input is not None:
        sharding = like_input
    elif mesh is not None:
        sharding = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(), memory_kind=kind
        )
    else:
        sharding = single_device_sharding(device, memory_kind=kind)
    return sharding

"""Compiling for a TPU without one, for `plan`: libtpu describes a chip's topology
(`jax.experimental.topologies.get_topology_desc(platform="tpu", ...)`), whose
compile-only devices have the chip's memories (`device`, `pinned_host`,
`unpinned_host`), so the step is lowered with shardings on them and compiled by the
topology's client (`compile_for`: what `jax.jit`'s compile calls, without its
persistent cache; the one private call is `compat.compile_for_devices`).
"""

import functools
import importlib.metadata
import importlib.util
import os
from typing import Any

from .._core.errors import PlanError


# What libtpu reads when it starts without a TPU: a one-chip host of the given type, no
# metadata server. Set for the plugin's start only (a v5e's; a topology of another chip
# is described all the same), the process's own values back after it.
_ENV = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_SKIP_MDS_QUERY": "1",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


def _install_hint() -> str:
    version = importlib.metadata.version("jax")
    return (f'Install the TPU compiler (no TPU is needed): `pip install "jax[tpu]=={version}"` '
            "(the libtpu that JAX pins), and run with JAX_PLATFORMS=cpu on a machine "
            "without a TPU.")


def check_available() -> None:
    """Raise a `PlanError` naming the fix unless libtpu is installed."""
    if importlib.util.find_spec("libtpu") is None:
        raise PlanError("plan: libtpu is not installed. " + _install_hint())


@functools.lru_cache(maxsize=None)
def topology(name: str) -> Any:
    """libtpu's compile-only topology `name` (e.g. `"v5e:2x2"`)."""
    from jax.experimental import topologies

    check_available()
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update({k: os.environ.get(k) or v for k, v in _ENV.items()})
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as error:  # libtpu's own failure
        raise PlanError(f"plan: libtpu could not describe the topology {name!r} ({error}). "
                        + _install_hint()) from error
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def devices(topologies: tuple[str, ...], n_devices: int) -> list[Any]:
    """The first `n_devices` chips of the first of `topologies` that has as many."""
    for name in topologies:
        found = list(topology(name).devices)
        if len(found) >= n_devices:
            return found[:n_devices]
    raise PlanError(f"plan: no TPU topology of {n_devices} chips among {list(topologies)}; "
                    "plan for fewer devices, or give a TpuTarget with a larger topology.")


def on_chips(args: Any, chips: list[Any]) -> Any:
    """`args` with every array leaf (a `jax.Array` or a `jax.ShapeDtypeStruct` with a
    sharding on this machine's devices) as a `jax.ShapeDtypeStruct` on `chips`: the
    same mesh shape, partition spec and memory kind, this machine's devices (in `id`
    order) standing for the chips in order.

    Every sharding becomes a `NamedSharding`, a single device's over a one-device mesh:
    with a `SingleDeviceSharding` in `pinned_host`, libtpu's compile types the argument
    as device memory (`tests/upstream/test_upstream_tpu_deviceless.py` pins it), and
    the plan would count the host state as device bytes."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from .._core.compat import is_single_device_sharding

    leaves = [x for x in jax.tree.leaves(args) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))]
    local = sorted({d for x in leaves for d in x.sharding.device_set}, key=lambda d: d.id)
    chip_of = dict(zip(local, chips))

    def move(x: Any) -> Any:
        if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            return x
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            mesh = sharding.mesh
            grid = np.vectorize(chip_of.__getitem__, otypes=[object])(np.asarray(mesh.devices))
            moved = NamedSharding(Mesh(grid, mesh.axis_names, axis_types=mesh.axis_types),
                                  sharding.spec, memory_kind=sharding.memory_kind)
        elif is_single_device_sharding(sharding):
            (device,) = sharding.device_set
            moved = NamedSharding(Mesh([chip_of[device]], ("_",)), PartitionSpec(),
                                  memory_kind=sharding.memory_kind)
        else:
            raise PlanError(
                f"plan: an argument ({x.dtype}{list(x.shape)}) has the sharding "
                f"{sharding!r}; a TPU plan takes a NamedSharding or a single device's "
                "(e.g. from `jax.make_mesh`).")
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=moved)

    return jax.tree.map(move, args)


def compile_for(jitted: Any, args: tuple[Any, ...], kwargs: dict[str, Any], chips: list[Any],
                compiler_options: dict[str, Any]) -> tuple[Any, dict[str, Any], Any]:
    """Lower the `filter_jit` call for `tpu` with its arguments on `chips` and compile
    it: the lowering, the XLA options, XLA's executable (`get_compiled_memory_stats()`,
    `hlo_modules()`).

    The module is compiled by the topology's client directly (`compat.compile_for_devices`,
    what `jax.jit`'s compile calls), not through `Lowered.compile`: that path consults
    JAX's persistent compilation cache, whose entry for a compile-only executable cannot
    be loaded back (there is no chip to load it on), so a second plan of the same step
    would fail (`tests/upstream/test_upstream_tpu_deviceless.py`). Turning the cache off
    around the compile would flip JAX's global configuration for every thread of the
    process; this route touches none of it. The executable is the one `Lowered.compile`
    makes (the same scheduled HLO and memory analysis, pinned by the same test file)."""
    from .._core import compat

    moved_args, moved_kwargs = on_chips((args, kwargs), chips)
    lowered = jitted.lower_for(("tpu",), moved_args, moved_kwargs)
    options = {**lowered.compiler_options, **compiler_options}
    return lowered, options, compat.compile_for_devices(
        lowered.compiler_ir("stablehlo"), chips, options)

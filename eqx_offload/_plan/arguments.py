"""The checks `plan` makes of what it is given before it compiles anything: its
options, and abstract arguments that carry a sharding on this process's devices."""

from typing import Any

from .._core.errors import OptionError, PlanError


def check_options(compiler_options: Any, host_memory: Any) -> None:
    """Raise an `OptionError` for a `compiler_options` or `host_memory` of `plan` that
    is not of its kind (`target` and `device_memory`: `resolve_target`)."""
    if compiler_options is not None and not isinstance(compiler_options, dict):
        raise OptionError(
            f"plan(compiler_options={compiler_options!r}): compiler_options must be a "
            "dict of XLA option names to values, or None."
        )
    if host_memory is not None and (isinstance(host_memory, bool) or not isinstance(
            host_memory, int) or host_memory <= 0):
        raise OptionError(
            f"plan(host_memory={host_memory!r}): host_memory must be an int > 0 (bytes "
            "of host memory for the planned chips together), or None."
        )


def check_abstract_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise a `PlanError` naming the argument's path for a `jax.ShapeDtypeStruct`
    without a sharding, or with one on devices that are not this process's (e.g. a
    compile-only topology's, whose devices the plan picks itself)."""
    import jax
    import jax.tree_util as jtu

    local = set(jax.devices())
    keyed = jtu.tree_flatten_with_path((args, kwargs))[0]
    for path, leaf in keyed:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            continue
        where = ("args" if path[0] == jtu.SequenceKey(0) else "kwargs") + jtu.keystr(path[1:])
        shape = f"{leaf.dtype}{list(leaf.shape)}"
        if leaf.sharding is None:
            raise PlanError(
                f"plan: the abstract argument {where} ({shape}) has no sharding, so the "
                "plan cannot tell which device or memory it is in. Give it one, e.g. "
                "`eqx_offload.checkpoint.restore_target(tree)` (every leaf on the default device, "
                "`where=` to host memory) or `jax.ShapeDtypeStruct(shape, dtype, sharding="
                "jax.sharding.NamedSharding(mesh, spec, memory_kind=...))`; "
                "`eqx_offload.checkpoint.filter_eval_shape` keeps the shardings a function gives."
            )
        if not isinstance(leaf.sharding, jax.sharding.Sharding) or not set(
                leaf.sharding.device_set) <= local:
            raise PlanError(
                f"plan: the abstract argument {where} ({shape}) has the sharding "
                f"{leaf.sharding!r}, whose devices are not this process's "
                f"({jax.devices()[0].platform} devices). The plan lowers with shardings on "
                "this machine's devices (they carry memory kinds; the chip is described "
                "by `target=`): build the sharding over `jax.devices()`, e.g. "
                "`jax.make_mesh(...)` (for several chips on a CPU machine, set "
                "`jax_num_cpu_devices` before JAX starts)."
            )

"""`plan`: what a step would hold in a GPU's or a TPU's memory, and whether its copies
between host and device overlap compute, from XLA's own compiler for that chip run
without one (XLA's GPU compiler, or libtpu).

The numbers are XLA's *plan* for the target (its buffer assignment and its schedule),
not a measurement: the device bytes are those XLA allocates for the executable, and a
copy "overlaps compute" when XLA's schedule puts at least one kernel between the copy's
start and its completion. How fast the copies actually are, and whether the runtime
overlaps them as scheduled, only the chip can say (`docs/gpu-plan.md`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Optional, Union

from .._core.errors import PlanError
from . import deviceless as _deviceless, tpu as _tpu
from .arguments import check_abstract_arguments, check_options
from .flops import matmul_flops
from .hlo import scheduled_collectives, scheduled_copies
from .kernels import scheduled_kernels
from .._core.memory import client_memory_fraction
from .result import Plan
from .targets import GpuTarget, resolve_target, Target, TpuTarget
from .timing import predict_seconds


def plan(
    fun: Callable[..., Any],
    *args: Any,
    target: Union[str, GpuTarget, TpuTarget],
    device_memory: Optional[int] = None,
    compiler_options: Optional[dict[str, Any]] = None,
    host_memory: Optional[int] = None,
    **kwargs: Any,
) -> Plan:
    """XLA's plan for `fun(*args, **kwargs)` on an NVIDIA GPU or a Google TPU, compiled
    on this machine without one: the device memory the step holds at its peak, the host
    memory it uses, and which of its host<->device copies XLA schedules under compute.

    Ask "does my step fit on an H100 (or a TPU v5e) with offload, and are the copies
    hidden?" from a laptop. **A plan, not a measurement**: the bytes are XLA's buffer
    assignment for that chip and the overlap is XLA's schedule; a copy's real duration
    and the step time need the chip itself. What the plans show, and how they compare
    with measured steps: `docs/gpu-plan.md`.

    **Arguments:**

    - `fun`: an `eqx_offload.filter_jit` function (its `donate` and `compiler_options`
        are used), or any function (compiled as `eqx_offload.filter_jit(fun)`).
    - `*args`, `**kwargs`: its arguments, as for a call: arrays on this machine's
        devices (e.g. the CPU; their memory kinds are what is planned), or
        `jax.ShapeDtypeStruct`s with shardings on those devices that carry the
        memory kinds (`eqx_offload.checkpoint.filter_eval_shape` of the model and of
        `optimizer.init`, or `eqx_offload.checkpoint.abstract_init`): a step of any size plans
        without allocating one of its arrays. Nothing runs. With a sharding over
        several devices (a `NamedSharding` of a `jax.make_mesh`), the plan is for as
        many chips.
    - `target`: a GPU (`"h200"`, `"h100"` (80 GB) or an `eqx_offload.planner.GpuTarget`,
        compiled by XLA's GPU compiler) or a TPU (`"v5e"`, `"v5p"`, `"v6e"` or an
        `eqx_offload.planner.TpuTarget`, compiled by libtpu).
    - `device_memory`: plan within this many bytes of device memory instead of the
        target's (on a GPU, XLA's scheduler keeps within it where it can; on a TPU only
        `Plan.fits` reads it); `Plan.fits` says whether the step does.
    - `compiler_options`: XLA options, added to `fun`'s own and to the defaults
        `filter_jit` compiles a step for the target with (`Plan.compiler_options` lists
        them all).
    - `host_memory`: the host memory (bytes) the process driving the planned chips has
        (e.g. 2 TB for an 8-GPU node); `Plan.host_fits` then checks it as well as a
        GPU's pinned host pool.

    **Returns:**

    A `Plan`; `print(plan.summary())` for a person.

    **Raises:**

    `PlanError` if the target's compiler is not installed (for a GPU, the `plan` extra:
    `jax-cuda12-plugin` at the installed JAX version and `nvidia-cuda-nvcc-cu12`; for a
    TPU, libtpu: `jax[tpu]` at the installed JAX version), an abstract argument has no
    sharding the plan can use, or XLA cannot compile the step for the target (on a TPU,
    also a step whose temporaries alone exceed its HBM: XLA:TPU refuses to compile it);
    `OptionError` for a bad `target`, `device_memory` or `host_memory`.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import optax
        import eqx_offload

        model = eqx.nn.MLP(256, 256, 256, 2, key=jax.random.key(0))
        opt = eqx_offload.offloaded(optax.adamw(1e-3))
        state = opt.init(eqx.filter(model, eqx.is_array))

        @eqx_offload.filter_jit(donate="all")
        def step(model, state, x):
            grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
            updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state

        plan = eqx_offload.plan(step, model, state, jnp.ones((64, 256)), target="v5e")
        print(plan.summary())
        assert plan.host_bytes > 0 and plan.copies_to("to_device")
        ```
    """
    import jax
    import jax.tree_util as jtu

    from .._jit.jit import filter_jit

    resolved = resolve_target(target, device_memory)
    tpu = isinstance(resolved, TpuTarget)
    fraction, source = (
        (1.0, "the given device_memory") if device_memory is not None
        else (1.0, "the HBM XLA:TPU makes available") if tpu else client_memory_fraction())
    check_options(compiler_options, host_memory)
    # A `filter_jit` function lowers through its public hook, `lower_for`.
    jitted = fun if callable(getattr(fun, "lower_for", None)) else filter_jit(fun)
    (_tpu if tpu else _deviceless).check_available()
    check_abstract_arguments(args, kwargs)
    shardings = [x.sharding for x in jtu.tree_leaves((args, kwargs))
                 if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))]
    n_devices = max(1, len({d for s in shardings for d in s.device_set}))
    compile_ = _compile_tpu if tpu else _compile
    lowered, options, executable = compile_(jitted, args, kwargs, resolved, n_devices,
                                            compiler_options)
    return _read_plan(executable, lowered.jaxpr, resolved, options, n_devices,
                      host_memory=host_memory, fraction=fraction, source=source)


def gpu_plan(
    fun: Callable[..., Any],
    *args: Any,
    target: Union[str, GpuTarget, TpuTarget] = "h200",
    device_memory: Optional[int] = None,
    compiler_options: Optional[dict[str, Any]] = None,
    host_memory: Optional[int] = None,
    **kwargs: Any,
) -> Plan:
    """`plan` with an H200 for the default `target` (its earlier name)."""
    return plan(fun, *args, target=target, device_memory=device_memory,
                compiler_options=compiler_options, host_memory=host_memory, **kwargs)


def _compile(jitted: Any, args: tuple[Any, ...], kwargs: dict[str, Any], resolved: Target,
             n_devices: int, compiler_options: Optional[dict[str, Any]],
             ) -> tuple[Any, dict[str, Any], Any]:
    """Lower the `filter_jit` call for `cuda` and compile it for `n_devices` of the
    target's compile-only topology: the lowering, the XLA options, the executable."""
    assert isinstance(resolved, GpuTarget)
    topology = _deviceless.topology(resolved.config_text(), n_devices)
    lowered = jitted.lower_for(("cuda",), args, kwargs)
    # What `filter_jit` compiles with on a GPU: its defaults, its own options, these.
    options = {**lowered.compiler_options, **(compiler_options or {})}
    try:
        executable = _deviceless.compile_for(lowered, list(topology.devices[:n_devices]),
                                             options)
    except Exception as error:
        raise PlanError(f"plan: XLA could not compile the step for {resolved.name}: "
                        f"{error}") from error
    return lowered, options, _Stats(executable.get_compiled_memory_stats(), "\n".join(
        m.to_string() for m in executable.hlo_modules()))


def _compile_tpu(jitted: Any, args: tuple[Any, ...], kwargs: dict[str, Any], resolved: Target,
                 n_devices: int, compiler_options: Optional[dict[str, Any]],
                 ) -> tuple[Any, dict[str, Any], Any]:
    """Lower the `filter_jit` call for `tpu` with its arguments on the first `n_devices`
    chips of the target's topology, and compile it with libtpu."""
    assert isinstance(resolved, TpuTarget)
    chips = _tpu.devices(resolved.topologies, n_devices)
    try:
        lowered, options, compiled = _tpu.compile_for(jitted, args, kwargs, chips,
                                                      compiler_options or {})
    except PlanError:
        raise
    except Exception as error:
        fit = (" (the step does not fit in the chip's HBM: XLA:TPU refuses a step whose "
               "temporaries exceed it)" if "RESOURCE_EXHAUSTED" in str(error) else "")
        raise PlanError(f"plan: XLA could not compile the step for {resolved.name}"
                        f"{fit}: {error}") from error
    return lowered, options, _Stats(compiled.get_compiled_memory_stats(), "\n".join(
        m.to_string() for m in compiled.hlo_modules()))


@dataclasses.dataclass(frozen=True)
class _Stats:
    """What a plan reads of a compiled step: XLA's memory statistics, its HLO text."""

    memory: Any
    text: str


def _read_plan(executable: _Stats, jaxpr: Any, resolved: Target, options: dict[str, Any],
               n_devices: int, *, host_memory: Optional[int], fraction: float,
               source: str) -> Plan:
    """The `Plan` of a compiled step: XLA's memory statistics, the copies and
    collectives of its scheduled HLO, and the flops of the traced program (`jaxpr`)."""
    stats, text = executable.memory, executable.text
    device_peak = (stats.argument_size_in_bytes + stats.temp_size_in_bytes
                   + stats.output_size_in_bytes - stats.alias_size_in_bytes)
    host = (stats.host_argument_size_in_bytes + stats.host_temp_size_in_bytes
            + stats.host_output_size_in_bytes - stats.host_alias_size_in_bytes)
    copies = scheduled_copies(text)
    hbm = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           + sum(c.nbytes * c.count for c in copies))
    planned = Plan(
        target=resolved.name,
        device_memory_size=resolved.device_memory_size,
        device_peak_bytes=int(device_peak),
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        host_bytes=int(host),
        host_limit_bytes=(None if isinstance(resolved, TpuTarget)
                          else _deviceless.host_pool_limit_bytes()),
        copies=copies,
        compiler_options=options,
        n_devices=n_devices,
        host_memory_bytes=host_memory,
        collectives=scheduled_collectives(text),
        matmul_flops={kind: n / n_devices for kind, n in matmul_flops(jaxpr).items()},
        hbm_bytes=int(hbm),
        chip=resolved,
        memory_fraction=fraction,
        memory_fraction_source=source,
        host_argument_bytes=int(stats.host_argument_size_in_bytes),
        host_output_bytes=int(stats.host_output_size_in_bytes),
        host_alias_bytes=int(stats.host_alias_size_in_bytes),
        host_temp_bytes=int(stats.host_temp_size_in_bytes),
        kernels=scheduled_kernels(text),
    )
    return dataclasses.replace(planned, predicted_step_seconds=predict_seconds(planned))

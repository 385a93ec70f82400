"""What differs between the supported JAX versions (0.10.2 to the newest), in one place.

Every other module imports the version-dependent names from here; each shim says which
JAX version changed what, so it can go once the oldest supported JAX has the change.
"""

import dis
import functools
import importlib
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Optional, TypeVar

import jax
import jax.extend.core as _jex
import jax.tree_util as _jtu
from jax.core import Tracer as _Tracer
from jax.experimental import compute_on as _compute_on
import numpy as _np


# The function form of `compute_on`, `host_compute(f, *, compute_type,
# out_memory_spaces)` or as a decorator factory without `f`. JAX 0.10 calls it
# `compute_on2` (its `compute_on` is the context manager `with compute_on("device_host"):`);
# JAX 0.11 removed the context manager and renamed `compute_on2` to `compute_on`.
# Both trace to the same `compute_on` primitive with a `compute_type` parameter.
host_compute: Callable[..., Any] = getattr(_compute_on, "compute_on2", None) or _compute_on.compute_on

# The types of the jaxprs that a primitive's parameters hold. JAX 0.10 has `Jaxpr` and
# `ClosedJaxpr` (a `Jaxpr` with its constants); JAX 0.12 merged them into one `Jaxpr`
# and left `jax.extend.core.ClosedJaxpr` as an alias that it does not export.
JAXPR_TYPES: tuple[type[Any], ...] = (_jex.Jaxpr, getattr(_jex, "ClosedJaxpr", _jex.Jaxpr))


# JAX 0.10's `optimization_barrier` makes a zero tangent or cotangent (that of a value
# not differentiated, such as a state passed to `jax.grad(f)` beside the argument) an
# array of zeros in device memory, whatever the memory of its primal; JAX 0.12 keeps it
# symbolic. A host-resident state leaf through a barrier then gets a device (co)tangent,
# and `jax.grad` through offloaded updates (Optax's meta-learning example) fails
# ("Expected cotangent type float32<host>[] but got float32[]"). `optimization_barrier` is the barrier whose
# tangents pass through as they are: it orders the values of the step, and its
# derivative is the identity (`tests/upstream/test_upstream_barrier_zeros.py` is the
# canary).
BARRIER_INSTANTIATES_ZEROS = jax.__version_info__ < (0, 12)


@jax.custom_jvp
def _barrier(*leaves: Any) -> list[Any]:
    return list(jax.lax.optimization_barrier(list(leaves)))


def _barrier_jvp(primals: Any, tangents: Any) -> tuple[list[Any], list[Any]]:
    return _barrier(*primals), list(tangents)


_barrier.defjvp(_barrier_jvp, symbolic_zeros=True)


def optimization_barrier(tree: Any) -> Any:
    """`jax.lax.optimization_barrier` whose derivative keeps a zero (co)tangent symbolic
    (as JAX 0.12's does), on every supported JAX."""
    if not BARRIER_INSTANTIATES_ZEROS:
        return jax.lax.optimization_barrier(tree)
    leaves, treedef = _jtu.tree_flatten(tree)
    return _jtu.tree_unflatten(treedef, _barrier(*leaves))


# The sharding of one device. JAX 0.12.1 deprecates `jax.sharding.SingleDeviceSharding`
# (the name warns on access, and the suite turns warnings into errors) for
# `make_single_device_sharding` (JAX 0.10 on) and `is_single_device_sharding` (0.12.1
# on), and says a later JAX will give a `NamedSharding` from the first, for which the
# second will be `False`. `tests/upstream/test_upstream_single_device.py` is the canary.
def single_device_sharding(device: Any, memory_kind: Optional[str] = None) -> jax.sharding.Sharding:
    """The sharding that places a whole array on `device`, in `memory_kind`."""
    sharding: jax.sharding.Sharding = jax.sharding.make_single_device_sharding(
        device, memory_kind=memory_kind)
    return sharding


def _is_single_device_sharding_before_0_12_1(sharding: Any) -> bool:
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)


is_single_device_sharding: Callable[[Any], bool] = getattr(
    jax.sharding, "is_single_device_sharding", _is_single_device_sharding_before_0_12_1)
"""Whether `sharding` is a `SingleDeviceSharding` (what `jax.device_put(x, device)` and
`single_device_sharding` give), without the deprecated name."""


# JAX 0.12.1 on the CPU cannot copy an array that a compiled program wrote to host memory:
# `jax.device_put` of a `jax.jit` output in 'pinned_host' or 'unpinned_host', to another
# memory or device, fails with "UNIMPLEMENTED: Unsupported layout used for PjRt CPU
# buffers: {1,0:S(5)} (original) vs. f32[4,64] (canonicalized)". The program's result
# layout names the host memory space (`S(5)`; `S(6)` unpinned), as in JAX 0.12.0.1,
# whose CPU client copied such a buffer; 0.12.1's compares the layout with the default
# one and refuses. An array that `jax.device_put` put in host memory has the default
# layout and copies, and a program takes either as an argument. So `device_put` brings
# such an array to the device memory of its devices with a jitted move first.
# `tests/upstream/test_upstream_host_output_copy.py` is the canary.
HOST_OUTPUT_COPY_FAILS = jax.__version_info__ >= (0, 12, 1)


def _cannot_copy(leaf: Any) -> bool:
    """Whether `leaf` may be a compiled program's output that JAX cannot copy (a concrete
    array in host memory on CPU devices, under `HOST_OUTPUT_COPY_FAILS`)."""
    return (
        HOST_OUTPUT_COPY_FAILS
        and isinstance(leaf, jax.Array)
        and not isinstance(leaf, _Tracer)
        and leaf.sharding.memory_kind in ("pinned_host", "unpinned_host")
        and all(getattr(d, "platform", None) == "cpu" for d in leaf.sharding.device_set)
    )


def _to_device(*leaves: Any) -> tuple[Any, ...]:
    # A move inside the program, not the identity: a `jax.jit` whose `out_shardings`
    # alone change the memory kind gives an array typed for its input's memory (JAX
    # 0.10 to 0.12.1).
    moved: tuple[Any, ...] = jax.device_put(leaves, jax.memory.Space.Device)
    return moved


@functools.lru_cache(maxsize=256)
def _copy_to(shardings: tuple[Any, ...]) -> Callable[..., tuple[Any, ...]]:
    return jax.jit(_to_device, out_shardings=shardings)


def _devices_in_order(sharding: Any) -> tuple[Any, ...]:
    """The devices a program on `sharding` runs on, in the order `jax.jit` compares."""
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh):
        return tuple(_np.asarray(mesh.devices).flat)
    return tuple(sorted(sharding.device_set, key=lambda d: d.id))


def device_put(leaves: list[Any], destinations: list[Any], *, src: list[Any]) -> list[Any]:
    """`jax.device_put(leaves, destinations, src=src)`, also for the host arrays that JAX
    0.12.1 cannot copy on the CPU: those go to the device memory of their own devices
    in a jitted move (one per set of devices), and on from there if that is not their
    destination."""
    stuck: dict[tuple[Any, ...], list[int]] = {}
    for i, leaf in enumerate(leaves):
        if _cannot_copy(leaf):
            stuck.setdefault(_devices_in_order(leaf.sharding), []).append(i)
    if not stuck:
        moved: list[Any] = jax.device_put(leaves, destinations, src=src)
        return moved
    out = list(leaves)
    fetched_to: dict[int, Any] = {}
    for indices in stuck.values():
        shardings = tuple(leaves[i].sharding.with_memory_kind("device") for i in indices)
        # (Inside a transformation, e.g. an eager `jax.grad`, these come back traced.)
        moved_here = _copy_to(shardings)(*(leaves[i] for i in indices))
        for i, sharding, leaf in zip(indices, shardings, moved_here, strict=True):
            out[i], fetched_to[i] = leaf, sharding
    rest = [i for i in range(len(out)) if fetched_to.get(i) != destinations[i]]
    if rest:
        moved = jax.device_put([out[i] for i in rest], [destinations[i] for i in rest],
                               src=[src[i] for i in rest])
        for i, leaf in zip(rest, moved, strict=True):
            out[i] = leaf
    return out



def copy(x: jax.Array) -> jax.Array:
    """A copy of `x` in the same placement (`jax.device_put(x, x.sharding,
    may_alias=False)`), also of a program's host output on JAX 0.12.1's CPU (through
    device memory)."""
    if _cannot_copy(x):
        copied: jax.Array = device_put([x], [x.sharding], src=[None])[0]
        return copied
    copied = jax.device_put(x, x.sharding, may_alias=False)
    return copied


# Tracebacks. Equinox leaves its files out of the tracebacks JAX filters
# (`register_exclusion`, file by file) and marks its drivers `__tracebackhide__`; this
# package registers its folder, so that a user's mistake shows the user's line and the
# message, not the library's frames between them. JAX has no public way to register a
# folder or to make a function a filtering boundary: `jax._src.traceback_util`'s
# `register_exclusion` and `api_boundary` (JAX 0.10 to 0.12; the canary is
# `tests/upstream/test_upstream_tracebacks.py`).
_F = TypeVar("_F", bound=Callable[..., Any])
_traceback_util: Any = importlib.import_module("jax._src.traceback_util")


def hide_frames(path: str) -> None:
    """Leave the frames of the files under `path` out of the tracebacks JAX filters."""
    _traceback_util.register_exclusion(path)


def boundary(fun: _F) -> _F:
    """`fun`, whose errors leave it with the frames that `hide_frames` hides (and JAX's
    own) out of their traceback, as an error leaving `jax.jit` does."""
    bounded: _F = _traceback_util.api_boundary(fun)
    return bounded


hide_frames(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MARKER_PREFIX = "eqx_offload."
"""The prefix of the `jax.named_scope`s that mark what `filter_jit` compiles for."""


def marked(kind: str) -> Any:
    """A `jax.named_scope` that marks what is traced inside it as `kind` (e.g.
    `"streamed"`), for `scopes` to find in the traced program."""
    return jax.named_scope(MARKER_PREFIX + kind)


def scopes(jaxpr: Any) -> frozenset[str]:
    """The kinds that `marked` scopes name in `jaxpr`'s equations, at any depth.

    JAX keeps a `jax.named_scope` in each equation's `source_info.name_stack` (transforms
    wrap it, `jvp(eqx_offload.streamed)`); `jax.extend` exposes the type but documents
    neither the attribute nor the text of its `str` (JAX 0.10 to 0.12 alike).
    `tests/upstream/test_upstream_name_stack.py` is the canary."""
    found: set[str] = set()
    for stack in _name_stacks(jaxpr):
        for part in stack.split(MARKER_PREFIX)[1:]:
            found.add(part.split(")")[0].split("/")[0])
    return frozenset(found)


def _name_stacks(jaxpr: Any) -> Iterator[str]:
    for eqn in jaxpr.eqns:
        yield str(eqn.source_info.name_stack)
        for sub in _jex.jaxprs_in_params(eqn.params):
            yield from _name_stacks(sub)


_JAX_DIR = os.path.dirname(str(jax.__file__)) + os.sep


def enclosing_donating_jit() -> Optional[str]:
    """The name of the function that an enclosing `jax.jit(..., donate_argnums=...)`
    traces (the caller runs inside it), if that jit donates anything; else `None`.

    JAX has no public way to ask, and the traced program cannot say: an outer jit's
    donation is a parameter of its own equation, which exists only after its trace.
    While it traces, JAX (0.10 to 0.12) holds the flags, one per flattened input, in
    the local `donated_invars` of `pjit._trace_for_jit`'s frame: this walks the stack to
    it. An `eqx.filter_jit(donate="none")` passes an empty `donate_argnums`, and does
    not count. `tests/upstream/test_upstream_donated_invars.py` is the canary. (The
    trace state JAX exposes holds no donation: the current `DynamicJaxprTrace`, its
    `JaxprStackFrame` and `DebugInfo` (function name, argument names) are all that
    `pe.trace_to_jaxpr` is given; the jit's `PjitInfo` and the flags stay in this frame.)"""
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_trace_for_jit" and code.co_filename.startswith(_JAX_DIR):
            donated: Any = frame.f_locals.get("donated_invars")
            if donated is not None and any(donated):
                fun = frame.f_locals.get("fun")
                return str(getattr(fun, "__qualname__", None) or type(fun).__name__)
        frame = frame.f_back
    return None


def source_frames(eqn: Any) -> list[tuple[str, int, str]]:
    """`(file, line, function)` of each frame of the Python traceback JAX recorded for a
    traced equation, innermost first: `eqn.source_info.traceback.frames`, which JAX keeps
    for its own error messages and offers no public accessor for
    (`tests/upstream/test_upstream_source_frames.py` is the canary). Empty if absent."""
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    return [(f.file_name, f.line_num, f.function_name) for f in getattr(traceback, "frames", ())]


def named_axes() -> tuple[Any, ...]:
    """The named axes of the trace in progress (`pmap`, `shard_map`,
    `vmap(axis_name=...)`): `jax.extend.core.unsafe_get_axis_names_DO_NOT_USE`, JAX's one
    way to ask, empty where a JAX lacks it (`tests/upstream/test_upstream_axis_names.py`
    is the canary)."""
    return tuple(getattr(_jex, "unsafe_get_axis_names_DO_NOT_USE", lambda: ())())


class MultiStepsParts(NamedTuple):
    """What `optax.MultiSteps(...)` was built from, as its `update` uses it."""

    opt: Any  # the wrapped optimizer, a `GradientTransformationExtraArgs`
    every_k_schedule: Callable[[Any], Any]  # gradient step -> mini-steps per step
    acc_update: Callable[..., Any]  # (grad, acc, *, n_acc) -> acc (mean or sum)
    should_skip_update_fn: Callable[..., Any]  # (updates, gradient_step, params) -> (skip, state)
    accumulator_dtype: Any


def multi_steps_parts(multi: Any) -> MultiStepsParts:
    """The parts of an `optax.MultiSteps`, so that `offloaded(MultiSteps(...))` can run
    MultiSteps' own arithmetic with the inner update inside the applying branch (optax's
    `update` runs the inner update at every mini-step and selects its result). Optax
    (0.2.8) keeps them in private attributes and has no public way to read them but
    `inner_opt`; `tests/upstream/test_upstream_multisteps.py` is the canary."""
    return MultiStepsParts(
        opt=multi._opt,
        every_k_schedule=multi._every_k_schedule,
        acc_update=multi._acc_update,
        should_skip_update_fn=multi._should_skip_update_fn,
        accumulator_dtype=multi._accumulator_dtype,
    )


_MEMORY_SPACE_MISMATCH = "memory_space of all inputs passed to `"


def memory_space_mismatch(error: BaseException) -> Optional[str]:
    """The primitive's name if `error` is JAX's refusal to trace an operation on operands
    in different memory spaces (a host-resident array with a device one: `ValueError:
    memory_space of all inputs passed to `add` must be the same`, raised while tracing
    by `jax/_src/lax/utils.py`'s `_default_memory_space_rule`, JAX 0.10 on); else `None`.
    JAX has no type for it, so it is known by its message
    (`tests/upstream/test_upstream_memory_space.py` pins it)."""
    message = str(error)
    if type(error) is not ValueError or not message.startswith(_MEMORY_SPACE_MISMATCH):
        return None
    return message[len(_MEMORY_SPACE_MISMATCH):].split("`", 1)[0]


_OPERANDS = "Got one operand with type: "
_OTHER_OPERAND = " and another operand with type: "


def mismatched_operands(error: BaseException) -> str:
    """The operands' types of a `memory_space_mismatch` error, as JAX's message writes
    them: `"float32<host>[3,3] with float32[3,3]"` (the message's text, pinned by
    `tests/upstream/test_upstream_memory_space.py`); the whole message where it lacks
    them."""
    return str(error).split(_OPERANDS, 1)[-1].replace(_OTHER_OPERAND, " with ")


_TRACES_FOLLOWED = 64  # nested traces followed outwards, at most


def tracer_origin(tracer: Any) -> tuple[Any, bool]:
    """The value `tracer` stands for in the outermost trace, and whether some trace
    computed it (an equation made it) rather than received it as an argument.

    JAX's `DynamicJaxprTracer` keeps the equation that made it (`parent`), and a value
    an inner trace (a scan's body) closed over maps to the outer value
    (`_trace.frame.constvar_to_val`): JAX's private fields (JAX 0.10 to 0.12;
    `tests/upstream/test_upstream_tracer_origin.py` is the canary). Where they are
    missing, `(tracer, False)`: the origin unknown."""
    for _ in range(_TRACES_FOLLOWED):
        if getattr(tracer, "parent", None) is not None:
            return tracer, True
        frame = getattr(getattr(tracer, "_trace", None), "frame", None)
        outer = getattr(frame, "constvar_to_val", {}).get(getattr(tracer, "val", None))
        if outer is None:
            return tracer, False
        tracer = outer
    return tracer, False


def caller_imports_from(passed: Callable[[types.FrameType], bool]) -> bool:
    """Whether the first frame out from the caller for which `passed(frame)` is false
    runs a `from module import name` (its instruction is `IMPORT_FROM`): CPython
    replaces an `AttributeError` that a module's `__getattr__` raises there by its bare
    "cannot import name", so a message must travel as an `ImportError`. CPython's
    frames and bytecode (`sys._getframe`, read as `dis` reads it;
    `tests/upstream/test_upstream_import_from.py` is the canary)."""
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None and passed(frame):
        frame = frame.f_back
    if frame is None:
        return False
    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] == dis.opmap["IMPORT_FROM"]


def compile_for_devices(module: Any, devices: list[Any], compiler_options: dict[str, Any]) -> Any:
    """Compile a StableHLO `module` for `devices` of another client than JAX's backend
    (a compile-only GPU topology's), one replica of `len(devices)` partitions (SPMD, as
    `jax.jit` compiles a sharded step), with XLA `compiler_options`. Returns XLA's
    loaded executable (`get_compiled_memory_stats()`, `hlo_modules()`).

    JAX compiles a module for a topology's devices only from a `jax.jit` lowered with
    shardings on them, and a compile-only GPU device has no memories, so such a
    sharding drops `pinned_host` (`plan` lowers with CPU shardings instead). This calls
    what `jax.jit` calls (`jax._src.compiler`, as JAX's own
    `tests/deviceless_aot_test.py` does; JAX 0.10 to 0.12 alike);
    `tests/upstream/test_upstream_deviceless.py` is the canary."""
    # Private modules, imported by name (no checker has stubs for them).
    compiler: Any = importlib.import_module("jax._src.compiler")
    xc: Any = importlib.import_module("jax._src.lib").xla_client
    # The device assignment is a (replicas, partitions) array.
    assignment = _np.empty((1, len(devices)), dtype=object)
    assignment[0, :] = devices
    options = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=len(devices),
        device_assignment=assignment,
        env_options_overrides=compiler_options,
    )
    return compiler.backend_compile_and_load(
        devices[0].client, module, xc.DeviceList(tuple(devices)), options, []
    )

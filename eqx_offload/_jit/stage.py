"""A `filter_jit` call's program, from its `call.Call`: traced once for the call's
arguments, analysed (`analyse`), lowered by a `jax.jit` given input *and*
output shardings with memory kinds (so JAX pairs a donated input only with an output
in the same memory) and JAX's trace of the first `jax.jit` (`lower_call`; `export_call` too);
compiled (`compile_program`) with its default XLA options (`default_compiler_options`);
run on a call, its result rebuilt (`run`). It holds the one channel of what the
library knows of a program it traces itself (`lowering_for`, `making_layer`)."""

import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.extend.core import jaxpr_as_fun, Literal

from .._core.compat import scopes
from .._core.leaves import paths_parts
from .._core.placement import output_shardings
from .call import Call
from .donation import UNUSABLE_DONATION
from .lint import check_no_host_compute, host_weights_leaf, memory_space_error, weight_leaf


@dataclasses.dataclass(frozen=True)
class Tracing:
    """What the library knows of a program it traces itself, that JAX's trace does not
    carry: the platforms it is lowered for (`lowering_platforms`) and, in a program of
    `filter_make`, the layer of the stacked layers it makes (`layer_being_made`).

    Both are set by the library around a trace it starts and read by library functions
    the user's code calls inside it, so no argument can carry them:

    - `filter_jit` knows its target before it traces: the platform of its arguments'
      devices for a call, the platforms given to `lower_for` and `export`. `jax.jit`
      lowers a traced program for any platform, so `offloaded`'s default update would
      otherwise trace one update for each platform and let `jax.lax.platform_dependent`
      keep one (`_optim/strategies.py`). A trace started elsewhere (`jax.jit`,
      `eqx.filter_jit`, `jax.export` of those) sees `None`: unknown.
    - `filter_make` runs the user's `fun`, which calls `stack_layers`; in the program that
      makes layer `i` of the stacks, `stack_layers` makes that layer alone
      (`_models/make.py`). Elsewhere it is `None`: the whole stack.
    """

    platforms: Optional[tuple[str, ...]] = None
    layer: Optional[Any] = None  # a traced int32 scalar


_TRACING: contextvars.ContextVar[Tracing] = contextvars.ContextVar(
    "eqx_offload_tracing", default=Tracing())


@contextlib.contextmanager
def _tracing(**changes: Any) -> Iterator[None]:
    token = _TRACING.set(dataclasses.replace(_TRACING.get(), **changes))
    try:
        yield
    finally:
        _TRACING.reset(token)


def lowering_for(platforms: Sequence[str]) -> contextlib.AbstractContextManager[None]:
    """Within: programs traced are lowered for `platforms` (JAX's names: `"cpu"`,
    `"cuda"`, `"rocm"`, `"tpu"`; `"gpu"`, a device's platform, stands for CUDA or ROCm)."""
    return _tracing(platforms=tuple(platforms))


def lowering_platforms() -> Optional[tuple[str, ...]]:
    """The platforms the program being traced is lowered for, or `None` if unknown."""
    return _TRACING.get().platforms


def making_layer(layer: Any) -> contextlib.AbstractContextManager[None]:
    """Within: `stack_layers` makes layer `layer` (a traced int32 scalar) alone."""
    return _tracing(layer=layer)


def layer_being_made() -> Optional[Any]:
    """The layer `stack_layers` makes alone, or `None`: the whole stack."""
    return _TRACING.get().layer


@dataclasses.dataclass
class Output:
    """How to rebuild a result: the flat output with `None` where the executable's
    arrays go, in the order of `positions`."""

    treedef: Any
    leaves: list[Any]
    positions: list[int]

    def rebuild(self, arrays: Sequence[Any]) -> Any:
        leaves = list(self.leaves)
        for i, x in zip(self.positions, arrays, strict=True):
            leaves[i] = x
        return jtu.tree_unflatten(self.treedef, leaves)


@dataclasses.dataclass(frozen=True)
class Program:
    """A call's program, lowered: what `jit.Lowered` shows, and compiles."""

    lowered: Any  # a `jax.stages.Lowered`
    output: Output
    jaxpr: Any  # the traced program (a closed jaxpr)
    compiler_options: dict[str, Any]  # `filter_jit`'s defaults for it, then the function's


@dataclasses.dataclass(frozen=True)
class Executable:
    """A call's program, compiled: what `run` runs."""

    compiled: Any  # a `jax.stages.Compiled`
    output: Output


@dataclasses.dataclass
class _Trace:
    """What tracing `fun` found: how to rebuild the result, the output paths, and (set
    after the first trace) the traced program."""

    output: Optional[Output] = None
    out_paths: list[Any] = dataclasses.field(default_factory=list)
    program: Any = None
    inputs: tuple[Any, ...] = ()  # the traced array leaves (for `_argument_of`)


@contextlib.contextmanager
def _silenced(silence: bool) -> Iterator[None]:
    """Within: JAX's warning about donated buffers it could not reuse is ignored if
    `silence` (the `"all"` modes of `donate=`)."""
    with warnings.catch_warnings():
        if silence:
            warnings.filterwarnings("ignore", message=UNUSABLE_DONATION)
        yield


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What `analyse` read from a traced program."""

    streamed: bool
    prefetched: bool
    whole: bool
    in_backward: bool
    out_constraints: tuple[Optional[Any], ...]  # per output: its sharding constraint, or None


def analyse(closed: Any, name: str,
            weights: Callable[[], Optional[str]] = lambda: None) -> Analysis:
    """One pass over a step's traced program `closed` (a closed jaxpr): what
    `filter_jit` must know about it before it compiles, read from the program itself.
    It computes on no host-resident array (`lint.check_no_host_compute`: a
    `CompositionError` naming `name`, and `weights()`, a host weight among the
    arguments, otherwise); the scopes it marks (`compat.scopes`): whether it streams,
    prefetches or fetches an `offloaded` state whole (the GPU's default options depend
    on it); and the sharding constraints on its outputs (`eqx.filter_shard` at the end
    of a step says where an output lives)."""
    jaxpr = closed.jaxpr
    check_no_host_compute(jaxpr, name, weights)
    constraints = {
        eqn.outvars[0]: eqn.params["sharding"] for eqn in jaxpr.eqns
        if eqn.primitive.name == "sharding_constraint" and not eqn.params.get("unconstrained_dims")
    }
    kinds = scopes(jaxpr)
    return Analysis(
        streamed="streamed" in kinds,
        prefetched="prefetched" in kinds,
        whole="whole" in kinds,
        in_backward="in_backward" in kinds,
        out_constraints=tuple(None if isinstance(v, Literal) else constraints.get(v)
                              for v in jaxpr.outvars),
    )


def _flat_fun(fun: Callable[..., Any], call: Call, found: _Trace) -> Callable[..., Any]:
    """`fun` on the call's array leaves alone (the static ones are `call`'s); records how
    to rebuild the result and the output paths in `found` when traced. Traced again
    where JAX's trace cache lacks the first trace (`export`'s specs drop weak types), it
    replays the program of the first (`found.program`): `fun` runs once."""
    array_positions = [i for i, a in enumerate(call.is_array) if a]

    def flat_fun(*dynamic_leaves: Any) -> list[Any]:
        if found.program is not None:
            return list(jaxpr_as_fun(found.program)(*dynamic_leaves))
        found.inputs = dynamic_leaves
        full = list(call.all_leaves)
        for i, x in zip(array_positions, dynamic_leaves, strict=True):
            full[i] = x
        args, kwargs = jtu.tree_unflatten(call.treedef, full)
        keyed_out, out_treedef = jtu.tree_flatten_with_path(fun(*args, **kwargs))
        positions = [i for i, (_, x) in enumerate(keyed_out) if eqx.is_array(x)]
        out_leaves = [None if eqx.is_array(x) else x for _, x in keyed_out]
        found.output = Output(out_treedef, out_leaves, positions)
        found.out_paths = paths_parts([keyed_out[i][0] for i in positions])
        return [keyed_out[i][1] for i in positions]

    # JAX names the executable (and its compile events, `jax.monitoring`) after this.
    flat_fun.__name__ = flat_fun.__qualname__ = getattr(fun, "__name__", "fun")
    return flat_fun


def _stage(fun: Callable[..., Any], name: str, call: Call,
           platforms: tuple[str, ...]) -> tuple[Any, Output, Any, Any]:
    """Trace `fun` once for `call`, to be lowered for `platforms` (what `offloaded`'s
    default update reads: `lowering_platforms`), and analyse the program: the
    `jax.jit` that lowers it with memory-kind-aware shardings (its trace is JAX's cached
    first one), how to rebuild the result, the closed jaxpr, and the
    `Analysis`."""
    found = _Trace()
    flat_fun = _flat_fun(fun, call, found)
    weights = lambda: host_weights_leaf(jtu.tree_unflatten(call.treedef, call.all_leaves))  # noqa: E731
    try:
        with lowering_for(platforms):
            closed = jax.jit(flat_fun, in_shardings=call.in_shardings).trace(*call.leaves).jaxpr
    except ValueError as error:  # JAX's "memory_space of all inputs ... must be the same"
        explained = memory_space_error(name, error, weights, _argument_of(call, found))
        if explained is None:
            raise
        raise explained from error
    analysis = analyse(closed, name, weights)
    found.program = closed
    # An argument's path without the leading args/kwargs index: `(0, ...)` is the
    # first positional argument, as `(0, ...)` is the first element of a tuple result.
    keyed_in = jtu.tree_flatten_with_path(jtu.tree_unflatten(call.treedef, call.all_leaves))[0]
    in_paths = paths_parts([keyed_in[i][0][1:] for i, a in enumerate(call.is_array) if a])
    out_shardings = output_shardings(
        closed.out_avals, found.out_paths, [jax.typeof(x) for x in call.leaves], in_paths,
        call.in_shardings, list(analysis.out_constraints),
    )
    jitted = jax.jit(flat_fun, in_shardings=call.in_shardings, out_shardings=out_shardings,
                     donate_argnums=call.donated)
    assert found.output is not None  # (set by the trace)
    return jitted, found.output, closed, analysis


def _argument_of(call: Call, found: _Trace) -> Callable[[Any], Optional[str]]:
    """For a traced value: the argument and path of the host weight it is, if it is one
    of the traced array leaves (`lint.weight_leaf`), else `None`."""
    def argument_of(tracer: Any) -> Optional[str]:
        index = next((i for i, x in enumerate(found.inputs) if x is tracer), None)
        if index is None:
            return None
        arguments = jtu.tree_unflatten(call.treedef, call.all_leaves)
        keyed = jtu.tree_flatten_with_path(arguments)[0]
        positions = [i for i, a in enumerate(call.is_array) if a]
        return weight_leaf(keyed[positions[index]][0], arguments)
    return argument_of


def lower_call(fun: Callable[..., Any], name: str, call: Call, silence: bool,
               compiler_options: Optional[dict[str, Any]],
               platforms: Optional[tuple[str, ...]] = None) -> Program:
    """`fun`'s program for `call`, lowered for `platforms` (default: the arguments' own;
    `gpu_plan` lowers for `("cuda",)` with CPU arguments), with `filter_jit`'s default
    XLA options for the first platform and this program, and `compiler_options`."""
    platform = platforms[0] if platforms else _platform_of(call)
    with _silenced(silence):
        jitted, output, closed, found = _stage(fun, name, call, platforms or (platform,))
        traced = jitted.trace(*call.leaves)
        lowered = traced.lower() if platforms is None else traced.lower(
            lowering_platforms=platforms)
    options = {**default_compiler_options(platform, found.streamed, found.prefetched,
                                          found.whole, found.in_backward),
               **(compiler_options or {})}
    return Program(lowered, output, closed, options)


def _platform_of(call: Call) -> str:
    """The platform of the call's devices (`"gpu"` for CUDA and ROCm), or JAX's default."""
    devices: list[Any] = [d for s in call.in_shardings for d in s.device_set]
    return str(devices[0].platform) if devices else jax.default_backend()


def compile_program(program: Program, compiler_options: dict[str, Any],
                    silence: bool) -> Executable:
    """`program` compiled with the XLA `compiler_options` (usually its own, which
    `jit.Lowered.compile` can add to)."""
    with _silenced(silence):
        return Executable(program.lowered.compile(compiler_options or None), program.output)


def export_call(fun: Callable[..., Any], name: str, call: Call, silence: bool,
                platforms: Optional[Sequence[str]]) -> Any:
    """`jax.export.export` of `fun`'s program for `call`, memory kinds kept."""
    with _silenced(silence):
        target = tuple(platforms) if platforms else (jax.default_backend(),)
        jitted = _stage(fun, name, call, target)[0]
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                 for x, s in zip(call.leaves, call.in_shardings, strict=True)]
        return jax.export.export(jitted, platforms=platforms)(*specs)


def run(executable: Executable, call: Call, silence: bool) -> Any:
    """Run a compiled executable on `call`'s array leaves and rebuild the result;
    consume what donation would have consumed (retyped and unshared copies)."""
    with _silenced(silence):
        flat_out = executable.compiled(*call.leaves)
    for i, x in call.retyped.items():
        if i in call.donated:  # the copy was donated: consume the original as donation would
            x.delete()
    for x in call.shared.values():  # a copy was donated in its place (`_unshare`)
        if not x.is_deleted() and all(
                x is not y for y in call.leaves):  # (kept where it was not donated)
            x.delete()
    return executable.output.rebuild(flat_out)


# ----------------------------------------------------------------------------------------
# The XLA options `filter_jit` compiles a step with by default: none, except for a GPU
# when the step streams an offloaded state, prefetches layer weights, or brings the whole
# state to the device in one update, and for a TPU when the step streams an offloaded
# state.

GPU_STREAMED_OPTIONS: dict[str, Any] = {
    "xla_gpu_experimental_parallel_async_compute_limit": 32,
    "xla_gpu_dot_merger_threshold_mb": 0,
}
"""What `filter_jit` compiles with by default for a GPU when the step streams an
offloaded state (see `default_compiler_options`)."""

GPU_WHOLE_STATE_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_analytical_sol_latency_estimator": False,
}
"""What `filter_jit` compiles with by default for a GPU when the step brings an
offloaded state to the device in one update (`group_bytes=None`, or the default where
the update cannot be streamed) and neither streams nor prefetches (see
`default_compiler_options`)."""

GPU_PREFETCHED_OPTIONS: dict[str, Any] = {
    "xla_gpu_experimental_parallel_async_compute_limit": 32,
}
"""What `filter_jit` compiles with by default for a GPU when the step prefetches layer
weights from host memory (`eqx_offload.scan_layers`) and streams no state."""

TPU_STREAMED_OPTIONS: dict[str, Any] = {
    "xla_tpu_host_transfer_overlap_limit": 1,
}
"""What `filter_jit` compiles with by default for a TPU when the step streams an
offloaded state (see `default_compiler_options`)."""

TPU_IN_BACKWARD_OPTIONS: dict[str, Any] = {
    "xla_tpu_host_transfer_overlap_limit": 2,
}
"""What `filter_jit` compiles with by default for a TPU when the step updates layers
inside the backward pass (`update_in_backward`; see `default_compiler_options`)."""

_GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})


def default_compiler_options(platform: str, streamed: bool, prefetched: bool = False,
                             whole: bool = False, in_backward: bool = False) -> dict[str, Any]:
    """The XLA options `filter_jit` compiles with unless its `compiler_options` (or
    `.compile(...)`'s) say otherwise: none, except for a GPU when the step runs
    `offloaded`'s streamed update (its default under `jit`, or `group_bytes=N`), or
    `scan_layers`' prefetch of host weights (then the copy limit alone: each layer's
    fetches, one per host leaf, wait for the layer before by data flow, so the limit
    lets them run side by side under that layer instead of one after the other), or
    the whole state in one update (`group_bytes=None`, or `"auto"` where the update
    cannot be streamed; then `GPU_WHOLE_STATE_OPTIONS`, below). They change the
    schedule and which matrix products XLA merges, not what any kernel computes
    element by element; the CPU backend gets none, so its programs (and results) are
    unchanged.

    - `xla_gpu_experimental_parallel_async_compute_limit=32`: XLA's GPU latency-hiding
        scheduler treats every host<->device copy as an asynchronous operation on one
        resource (`kGpuAsyncStreamComputes`), of which this many may be in flight at
        once (XLA's default: 2; `GpuAsyncTracker::GetNumAvailableResources` in
        `xla/service/gpu/gpu_latency_hiding_scheduler.cc`). The streamed update moves
        several state leaves each way per group (Adam: `mu` and `nu` of every
        parameter), so with 2 the copies of a group wait for each other and run back to
        back with no kernel under them. The barriers of the streamed update, not this
        limit, bound how much state is on the device; the whole state in one update does
        not get it.
    - `xla_gpu_dot_merger_threshold_mb=0`: XLA merges matrix products that share an
        operand (a transformer's q, k and v projections) into one; in a step with the
        streamed update's copies, its scheduler then keeps the merged product alive from
        the forward pass to the backward pass, where separate products are freed one by
        one.
    - `xla_gpu_enable_analytical_sol_latency_estimator=False`, for the whole state in
        one update only. That update's copies to the device wait for the gradients (a
        barrier). XLA's speed-of-light cost model (its default on Hopper and Blackwell)
        finds a copy worth hiding under compute and starts it early; the older
        estimator (`GpuLatencyEstimator`, XLA's default before Hopper) keeps no kernel
        under a copy, so each leaf comes to the device near its update and leaves right
        after. It changes the estimates the scheduler orders by for the whole step.

    - `xla_tpu_host_transfer_overlap_limit=1`, for a TPU when the step streams: how many
        host<->device transfers XLA:TPU's scheduler keeps in flight. With libtpu's
        default it starts a group's copies in one direction together (`mu` and `nu`)
        and the other direction's after them, one direction at a time; with 1 it pairs
        each copy to the device with one to host, so both directions of the link run at
        once (the docs page "Streamed update" has the counts from XLA:TPU's schedule).
        2 where the step updates layers inside the backward pass (`update_in_backward`,
        but for 8-bit state):
        each iteration's reads and writes of a layer's state then run two at a time
        under its VJP, and the time model (`plan(...).predicted_step_seconds`) plans
        the step faster.

    What each option does to the plans of the benchmark's workloads: the "GPU plan"
    docs page."""
    if platform.lower() == "tpu":
        if in_backward:
            return dict(TPU_IN_BACKWARD_OPTIONS)
        return dict(TPU_STREAMED_OPTIONS) if streamed else {}
    if platform.lower() not in _GPU_PLATFORMS:
        return {}
    if streamed:
        return dict(GPU_STREAMED_OPTIONS)
    if prefetched:
        return dict(GPU_PREFETCHED_OPTIONS)
    if whole:
        return dict(GPU_WHOLE_STATE_OPTIONS)
    return {}

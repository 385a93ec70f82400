"""`filter_jit`: `eqx.filter_jit` with memory-kind-aware shardings, safe to donate
host-resident state to, with an ahead-of-time API (`.lower(...).compile()`).

One call: flatten the arguments once (`_flatten_call`: array leaves are traced,
everything else is static), look the configuration up in the cache, run the
executable, rebuild the output. One compilation (`_lower`): trace the function once
with the arguments' shardings, check it computes on no host-resident array, read each
output's memory space from the traced program, and compile a replay of that program
with input *and* output shardings that carry memory kinds (so JAX pairs a donated input
only with an output in the same memory). The user's function runs once per compilation.
"""

import contextvars
import dataclasses
import functools
import inspect
import os
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Generic, Optional, overload, ParamSpec, TypeVar, Union

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.extend.core import jaxprs_in_params, Literal

from ._deviceless import compiling_for
from ._errors import CompositionError, DonationError, OptionError, SignatureError
from ._jaxpr import evaluate, is_var
from ._leaves import path_parts
from ._placement import input_shardings, is_mistyped_host, output_shardings, retype_host
from ._state import OffloadWarning
from ._types import Donate


_P = ParamSpec("_P")
_T = TypeVar("_T")

_DONATE_MODES: dict[str, tuple[bool, bool, bool]] = {
    # mode: (donate first argument, donate the rest, silence unusable-donation warnings)
    "all": (True, True, True),
    "all-except-first": (False, True, True),
    "warn": (True, True, False),
    "warn-except-first": (False, True, False),
    "none": (False, False, False),
}
_UNUSABLE_DONATION = "Some donated buffers were not usable"


@dataclasses.dataclass(frozen=True)
class _Donation:
    """What a `filter_jit` function donates: by mode (`donate="all"`, ...: the first
    argument and the rest), or by parameter name (`donate=("model", "opt_state")`)."""

    first: bool
    rest: bool
    silence: bool  # JAX's warning about donated buffers it could not reuse
    names: Optional[frozenset[str]] = None
    positional: tuple[str, ...] = ()  # `fun`'s positional parameters, in order
    varargs: Optional[str] = None  # its `*args`, if any

    def per_argument(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[bool]:
        """Whether each argument (of `args`, then `kwargs` by sorted key, the order of
        `jax.tree.leaves`) is donated by name (a mode needs no per-argument flags:
        `_flatten_call`)."""
        names = self.names or frozenset()
        return ([self.argument_name(i) in names for i in range(len(args))]
                + [k in names for k in sorted(kwargs)])

    def argument_name(self, i: int) -> Optional[str]:
        """The parameter that positional argument `i` binds to, if known."""
        return self.positional[i] if i < len(self.positional) else self.varargs


def _parameters(fun: Optional[Callable[..., Any]]
                ) -> tuple[tuple[str, ...], Optional[str], set[str], bool]:
    """`fun`'s positional parameters, its `*args` name, every name it accepts, and
    whether it takes `**kwargs` (nothing known where it has no signature)."""
    positional: list[str] = []
    varargs: Optional[str] = None
    accepted: set[str] = set()
    var_keyword = fun is None
    parameters: list[inspect.Parameter] = []
    try:
        if fun is not None:
            parameters = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):  # a builtin or a C callable: nothing known
        var_keyword = True
    for p in parameters:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            varargs = p.name
        elif p.kind is p.VAR_KEYWORD:
            var_keyword = True
            continue
        accepted.add(p.name)
    return tuple(positional), varargs, accepted, var_keyword


def _donation(donate: Any, fun: Optional[Callable[..., Any]]) -> _Donation:
    """`filter_jit`'s `donate=` checked: a mode, or names of `fun`'s parameters."""
    modes = ", ".join(repr(m) for m in _DONATE_MODES)
    positional, varargs, accepted, var_keyword = _parameters(fun)
    if isinstance(donate, str):
        if donate not in _DONATE_MODES:
            raise OptionError(
                f"filter_jit(donate={donate!r}): donate must be one of {modes}, or a tuple "
                "of the names of the parameters to donate."
            )
        return _Donation(*_DONATE_MODES[donate], None, positional, varargs)
    if not (isinstance(donate, (tuple, list, frozenset, set))
            and all(isinstance(n, str) for n in donate)):
        raise OptionError(
            f"filter_jit(donate={donate!r}): donate must be one of {modes}, or a tuple of "
            "the names of the parameters to donate (e.g. donate=(\"model\", \"opt_state\"))."
        )
    unknown = sorted(set(donate) - accepted)
    if unknown and not var_keyword:
        raise OptionError(
            f"filter_jit(donate={tuple(donate)!r}): {', '.join(map(repr, unknown))} "
            f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} of "
            f"{getattr(fun, '__qualname__', fun)!s}; its parameters are "
            f"{', '.join(map(repr, sorted(accepted))) or 'none'}."
        )
    return _Donation(True, True, True, frozenset(donate), positional, varargs)


def _check_not_deleted(all_leaves: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                       donate: _Donation, name: str) -> None:
    """A `DonationError` naming the argument and the leaf, where an array of the call
    was deleted (an earlier call that donated it consumed it): JAX would only say
    "Array has been deleted with shape=..."."""
    if not any(isinstance(x, jax.Array) and x.is_deleted() for x in all_leaves):
        return
    for path, x in jtu.tree_flatten_with_path((args, kwargs))[0]:
        if not (isinstance(x, jax.Array) and x.is_deleted()):
            continue
        kind, key, rest = path[0], path[1], path[2:]
        if getattr(kind, "idx", 0) == 0:  # args
            i = getattr(key, "idx", 0)
            parameter = donate.argument_name(i)
            where = f"args[{i}]" + (f" (`{parameter}`)" if parameter else "")
        else:
            where = f"`{getattr(key, 'key', key)}`"
        leaf = jtu.keystr(tuple(rest)) or "(the argument itself)"
        raise DonationError(
            f"filter_jit({name}): {where}, leaf {leaf} ({x.dtype}{list(x.shape)}) has been "
            "deleted: an earlier call that donated it consumed it (with donate=\"all\" a "
            "function consumes every array passed to it, also those it does not return). "
            "Pass the value that call returned in its place; or, for an argument the "
            "donating function only reads (a model passed to the other model's step), "
            "donate only what it returns, by parameter name: "
            "`filter_jit(step, donate=(\"model\", \"opt_state\"))`."
        )


# ----------------------------------------------------------------------------------------
# The host-compute check

# Primitives that may hold or pass along host-resident values without computing on them:
# transfers and placements (a sharding constraint, such as `eqx.filter_shard` inside
# the step, only says where a value lives), and the calls and control flow whose
# sub-jaxprs are checked in turn (XLA's host offloader accepts these on host buffers).
_PASS_THROUGH = frozenset({
    "device_put", "copy", "copy_p", "sharding_constraint", "mesh_cast", "reshard",
    "jit", "pjit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call",
    "custom_vjp_call", "cond", "while", "scan", "shard_map", "optimization_barrier",
    # `jax.checkpoint` binds `remat2` (JAX 0.10 to 0.12): a rematted layer whose weights
    # or saved residuals live in host memory (parameter and activation offload) only
    # passes them through.
    "remat2",
    # `jax.custom_batching.custom_vmap` (`scan_layers`' prefetched passes): its
    # sub-jaxpr is checked in turn.
    "custom_vmap_call",
    # Equinox's identities (used by its loops and by optimistix's solvers):
    # `select_if_vmap` returns its first operand as is outside `vmap`
    # (`equinox/internal/_loop/common.py`; under `vmap` it becomes the `select_n` this
    # check then sees); `nontraceable`, `nondifferentiable_backward` and `nonbatchable`
    # return their operand (`equinox/internal/_nontraceable.py`).
    "select_if_vmap", "nontraceable", "nondifferentiable_backward", "nonbatchable",
    # Rows read from and written into a host buffer (the streamed update's pieces of a
    # stacked leaf): XLA's host offloader makes these asynchronous copies.
    "slice", "dynamic_slice", "dynamic_update_slice",
})
# What usually puts each kind of operation on host-resident state, and the fix.
_SELECT_HINT = (
    "The usual cause is a combinator that chooses between the old and the new state of "
    "what it wraps, placed around `offloaded`: write `offloaded(optax.MultiSteps(...))`, "
    "not `optax.MultiSteps(offloaded(...))` (`offloaded` outermost is always safe)."
)
_GENERIC_HINT = (
    "The usual cause is code outside `offloaded` that reads the optimizer state (a "
    "combinator around `offloaded` that computes on its state, or reading a state leaf "
    "in the step): put that transformation inside `offloaded(...)` (outermost is always "
    "safe), or bring what you read to the device first with `eqx_offload.to_device(...)` "
    "(attributes read through an `OffloadedState` come to the device by themselves)."
)
_HINTS = {"select_n": _SELECT_HINT, "select_and_scatter_add": _SELECT_HINT}
_JAX_DIR = os.path.dirname(str(jax.__file__)) + os.sep


# Off only for the upstream canary (tests/upstream/test_upstream_donation.py), which
# shows what plain JAX does without it.
CHECK_FOREIGN_DONATION = True


def foreign_donation() -> Optional[str]:
    """The function of an enclosing `jax.jit(..., donate_argnums=...)` (or
    `donate_argnames`) that is tracing the caller, if any: `nnx.jit` and
    `eqx.filter_jit` with donation are such jits. Read from JAX's tracing frame
    (`pjit._trace_for_jit`, which holds `donated_invars`, one flag per flattened
    input, while it traces: JAX 0.10 to 0.12), as JAX offers no public way to ask; an
    `eqx.filter_jit(donate="none")` passes `jax.jit` a `donate_argnums` whose argument
    is empty, and does not count. `None` where no enclosing jit donates anything (or
    the frame is not found: tests/test_trap.py and test_programs.py fail then)."""
    if not CHECK_FOREIGN_DONATION or getattr(jax.config, "jax_debug_nans", False):
        # (JAX donates nothing under debug_nans)
        return None
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


def _where_in_source(eqn: Any) -> str:
    """`" (at file:line in function)"` for the innermost frame outside JAX, or `""`."""
    traceback = getattr(eqn.source_info, "traceback", None)
    for frame in getattr(traceback, "frames", ()):
        if not frame.file_name.startswith(_JAX_DIR):
            return f" (at {frame.file_name}:{frame.line_num} in {frame.function_name})"
    return ""


def _host_compute(jaxpr: Any, outer_source: str = "") -> Optional[tuple[str, str]]:
    """The first equation, at any depth, that computes on a host-memory value outside
    `compute_on(..., compute_type="device_host")`: its primitive's name and a
    description; `None` if there is none. (`outer_source`: where the enclosing call is,
    for equations of a sub-jaxpr that lack their own.)"""
    for eqn in jaxpr.eqns:
        source = _where_in_source(eqn) or outer_source
        if "device_host" in (getattr(eqn.ctx, "compute_type", None),
                             eqn.params.get("compute_type")):  # `compute_on`, `compute_on2`
            continue
        host = [
            v.aval for v in (*eqn.invars, *eqn.outvars)
            if not isinstance(v, Literal)
            and getattr(v.aval, "memory_space", None) == jax.memory.Space.Host
        ]
        if host and eqn.primitive.name not in _PASS_THROUGH:
            operands = ", ".join(dict.fromkeys(a.str_short() for a in host))
            return eqn.primitive.name, f"`{eqn.primitive.name}` on {operands}{source}"
        for sub in jaxprs_in_params(eqn.params):
            found = _host_compute(sub, source)
            if found is not None:
                return found
    return None


def _check_no_host_compute(jaxpr: Any, name: str) -> None:
    found = _host_compute(jaxpr)
    if found is None:
        return
    primitive, described = found
    raise CompositionError(
        f"filter_jit({name}): the function computes on host-resident arrays: "
        f"{described}. Arrays that `offloaded` keeps in host memory may only be moved, "
        "never computed on: on a GPU, XLA runs such an operation on the host (slowly) or "
        f"refuses to compile it. {_HINTS.get(primitive, _GENERIC_HINT)} To compute on "
        "the host on purpose, use `jax.experimental.compute_on.compute_on` with "
        "compute_type='device_host'."
    )


# ----------------------------------------------------------------------------------------
# One call's arguments


@dataclasses.dataclass
class _Call:
    """The arguments of one call, flattened once."""

    all_leaves: list[Any]
    treedef: Any
    is_array: tuple[bool, ...]
    leaves: list[Any]  # the array leaves, in order: what the executable takes
    donated: tuple[int, ...]  # indices into `leaves`
    retyped: dict[int, jax.Array]  # index into `leaves` -> the mistyped original
    in_shardings: list[jax.sharding.Sharding]
    key: tuple[Any, ...]  # what selects the executable
    shared: dict[int, jax.Array] = dataclasses.field(default_factory=dict)  # see `_unshare`


def _unshare(leaves: list[Any], donated: Sequence[int]) -> dict[int, jax.Array]:
    """Give every donated leaf a buffer of its own: where one array stands at several
    leaves (Equinox's `eqx.nn.State(model)` shares arrays with the model; a tied
    embedding) and is donated at one of them, the other donated places get a copy
    (`leaves` is changed in place). Donating one buffer twice is what JAX refuses
    ("Attempt to donate the same buffer twice"); passing it donated once and undonated
    elsewhere would let XLA overwrite what the other input still reads. The original
    goes to the first donated place if every place is donated (so it is consumed, as
    donation promises), else it stays where it is not donated (the caller keeps it).
    Returns index -> original for the places that got a copy, which are consumed after
    the call. The executable is the same whatever the sharing: one compilation."""
    places: dict[int, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array):
            places.setdefault(id(x), []).append(i)
    donated_set = set(donated)
    shared: dict[int, jax.Array] = {}
    for where in places.values():
        if len(where) < 2:
            continue
        donated_here = [i for i in where if i in donated_set]
        if not donated_here:
            continue
        keep = donated_here[0] if len(donated_here) == len(where) else None
        for i in donated_here:
            if i != keep:
                shared[i] = leaves[i]
                leaves[i] = jax.device_put(leaves[i], leaves[i].sharding, may_alias=False)
    return shared


def _flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any], donate: _Donation,
                  abstract: bool = False, name: str = "fun") -> _Call:
    """The call's arguments, flattened once. With `abstract` (`gpu_plan`), a
    `jax.ShapeDtypeStruct` leaf stands for an array too: the step is traced and
    compiled for it, and nothing is allocated (a caller checks it has a sharding)."""
    all_leaves, treedef = jtu.tree_flatten((args, kwargs))
    is_array = tuple(
        eqx.is_array(x) or (abstract and isinstance(x, jax.ShapeDtypeStruct)) for x in all_leaves)
    # Which argument each leaf is of matters only where the arguments are donated
    # differently: for a mode, the first argument's leaves (`n_first`, a part of the
    # key); by name, every argument's (counted only then: this runs at every call).
    n_first = 0
    if donate.names is None:
        if donate.first != donate.rest:
            first_def: Any = jtu.tree_structure(args[:1])  # `PyTreeDef` is untyped for mypy
            n_first = first_def.num_leaves
        flags = [donate.first if i < n_first else donate.rest for i in range(len(all_leaves))]
    else:
        arguments = list(args) + [kwargs[k] for k in sorted(kwargs)]
        sizes: list[int] = [len(jtu.tree_leaves(a)) for a in arguments]
        flags = [d for d, n in zip(donate.per_argument(args, kwargs), sizes, strict=True)
                 for _ in range(n)]
    if not abstract:
        _check_not_deleted(all_leaves, args, kwargs, donate, name)
    leaves: list[Any] = []
    donated: list[int] = []
    for x, a, d in zip(all_leaves, is_array, flags, strict=True):
        if a:
            if d:
                donated.append(len(leaves))
            leaves.append(x)
    shared = _unshare(leaves, donated) if donated else {}
    retyped = {i: x for i, x in enumerate(leaves) if is_mistyped_host(x)}
    for i, x in retyped.items():
        leaves[i] = retype_host(x)
    shardings = input_shardings(leaves)
    key = (
        treedef,
        is_array,
        n_first if donate.names is None else tuple(donated),
        # The non-array leaves, by value and type (as `eqx.filter_jit`, they must be
        # hashable: `1` and `1.0` or `True` must not share an executable).
        tuple((type(x), x) for x, a in zip(all_leaves, is_array, strict=True) if not a),
        tuple(
            (x.shape, x.dtype, getattr(x, "weak_type", False), s)
            for x, s in zip(leaves, shardings, strict=True)
        ),
    )
    return _Call(all_leaves, treedef, is_array, leaves, tuple(donated), retyped, shardings,
                 key, shared)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, complex)) and not isinstance(x, bool)


def _changed_number(cached: Any, call: _Call) -> Optional[tuple[int, Any, Any]]:
    """Where `call` differs from a configuration in `cached` (keys of `_flatten_call`)
    only in the values of Python numbers (static here, traced by `jax.jit`): the
    index into `call.all_leaves` of the first, its old value and its new one."""
    static_at = [i for i, a in enumerate(call.is_array) if not a]
    for key in cached:
        if key[:3] != call.key[:3] or key[4] != call.key[4]:
            continue
        changed = [j for j, (old, new) in enumerate(zip(key[3], call.key[3], strict=True))
                   if old != new]
        if changed and all(_is_number(key[3][j][1]) and _is_number(call.key[3][j][1])
                           for j in changed):
            return static_at[changed[0]], key[3][changed[0]][1], call.key[3][changed[0]][1]
    return None


def _warn_changed_number(cached: Any, call: _Call, donate: _Donation, name: str) -> bool:
    """Warn (and return `True`) where `call` compiles again only because a Python
    number changed: a Flax linen `TrainState`'s `step=0` compiles at every step."""
    found = _changed_number(cached, call)
    if found is None:
        return False
    i, old, new = found
    arguments = jtu.tree_unflatten(call.treedef, call.all_leaves)
    path = jtu.tree_flatten_with_path(arguments)[0][i][0]
    if getattr(path[0], "idx", 0) == 0:
        parameter = donate.argument_name(getattr(path[1], "idx", 0))
        where = f"`{parameter}`" if parameter else f"args[{getattr(path[1], 'idx', 0)}]"
    else:
        where = f"`{getattr(path[1], 'key', path[1])}`"
    leaf = jtu.keystr(tuple(path[2:])) or "(the argument itself)"
    warnings.warn(
        f"filter_jit({name}): pass this number as an array (`jnp.asarray(...)`), or use "
        f"`eqx_offload.jit`, which traces Python numbers as `jax.jit` does: {where}, leaf "
        f"{leaf} is a Python {type(new).__name__}, static here, and its change ({old!r} -> "
        f"{new!r}) compiled the function again. (Shown once; see \"Getting started\".)",
        OffloadWarning, stacklevel=3)
    return True


# ----------------------------------------------------------------------------------------
# Lowering, compiling, running


@dataclasses.dataclass
class _Output:
    """How to rebuild a result: the flat output with `None` where the executable's
    arrays go, in the order of `positions` (and whether the program streams an
    offloaded state, which selects `default_compiler_options`)."""

    treedef: Any
    leaves: list[Any]
    positions: list[int]
    streamed: bool = False
    prefetched: bool = False
    whole: bool = False

    def rebuild(self, arrays: Sequence[Any]) -> Any:
        leaves = list(self.leaves)
        for i, x in zip(self.positions, arrays, strict=True):
            leaves[i] = x
        return jtu.tree_unflatten(self.treedef, leaves)


# ----------------------------------------------------------------------------------------
# The default XLA options


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

_GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})


def default_compiler_options(platform: str, streamed: bool,
                             prefetched: bool = False, whole: bool = False) -> dict[str, Any]:
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
        limit, bound how much state is on the device; without them (the whole state in
        one update, `group_bytes=None`) the limit lets every copy start during the
        forward pass (in the plan of an MLP 2048 x 8: 580 MiB at the peak instead of
        500 MiB), so that mode does not get it.
    - `xla_gpu_dot_merger_threshold_mb=0`: XLA merges matrix products that share an
        operand (a transformer's q, k and v projections) into one; in a step with the
        copies, its scheduler then keeps the merged product alive from the forward pass
        to the backward pass (in the plan of the benchmark's transformer, 8 x 48 MiB at
        the peak), where separate products are freed one by one.

    In XLA's plan (H200, `eqx_offload.gpu_plan`), with the streamed update's barrier on
    the previous group's update, they take the default `offloaded(optax.adamw(...))`
    step of the benchmark's 118M-parameter transformer from 4687 MiB with 51% of its
    state's copies under compute to 4427 MiB with 100% (4683 MiB with the limit alone;
    see the "GPU plan" docs page for every workload).

    - `xla_gpu_enable_analytical_sol_latency_estimator=False`, for the whole state in
        one update only. The update has no barriers, so where each state leaf's copy
        to the device starts is the latency-hiding scheduler's choice. With its
        speed-of-light cost model (XLA's default on Hopper and Blackwell) a copy is
        worth hiding, and the scheduler starts every one of them before the first
        forward kernel: the whole state is on the device through the forward and
        backward passes, next to the activations, and the step holds more than the
        step without offload (whose state, donated, is updated in place). This option
        is XLA's escape hatch back to its older latency estimator
        (`GpuLatencyEstimator`, the one XLA uses on GPUs before Hopper), under which
        the scheduler keeps no kernel under a copy: each new state leaf goes back to
        host right after its update, and each copy to the device runs where the
        scheduler puts it, with nothing under it. In XLA's plan (H200) of the MLP
        2048 x 8, batch 256, each leaf then comes just before its update, after the
        backward pass: 244 MiB instead of 500 MiB (no offload: 508 MiB); of the
        benchmark's 118M-parameter transformer: 4607 MiB instead of 5492 MiB (5262).
        Of the MLP 1024 x 4, batch 8192, the copies to the device still all run
        before the forward pass, and the step plans at 320 MiB instead of 332 MiB
        (324) only by how the rest is scheduled: a margin, not a bound. The price: no
        copy of the state overlaps compute (before, the copies to host did; the copies
        to the device ran back to back before the first kernel either way). The
        option changes the estimates the scheduler orders by for the whole step: what
        it does to the collectives of a multi-device step has not been planned
        here."""
    if platform.lower() not in _GPU_PLATFORMS:
        return {}
    if streamed:
        return dict(GPU_STREAMED_OPTIONS)
    if prefetched:
        return dict(GPU_PREFETCHED_OPTIONS)
    if whole:
        return dict(GPU_WHOLE_STATE_OPTIONS)
    return {}


_STREAMED: "contextvars.ContextVar[Optional[list[str]]]" = contextvars.ContextVar(
    "eqx_offload_streamed", default=None)


def note_streamed(kind: str = "streamed") -> None:
    """Called by `offloaded` when it traces the streamed update (`"streamed"`), and by
    `scan_layers` when it traces its prefetch (`"prefetched"`): the program being
    traced by `filter_jit` gets `default_compiler_options`."""
    found = _STREAMED.get()
    if found is not None:
        found.append(kind)


_LATE_PARAMS: "contextvars.ContextVar[Optional[dict[int, tuple[Any, Any]]]]" = (
    contextvars.ContextVar("eqx_offload_late_params", default=None))


def late_params() -> Optional[dict[int, tuple[Any, Any]]]:
    """While `filter_jit` traces a step: the table in which `with_host_params` records,
    for each host-resident parameter it was given (by `id`, with the parameter itself),
    that parameter made to wait for its gradient, so that `apply_updates` fetches the
    same value (one copy to the device, after the gradient). `None` outside such a
    trace."""
    return _LATE_PARAMS.get()


def _platform_of(call: _Call) -> str:
    """The platform of the call's devices (`"gpu"` for CUDA and ROCm), or JAX's default."""
    devices: list[Any] = [d for s in call.in_shardings for d in s.device_set]
    return str(devices[0].platform) if devices else jax.default_backend()


def _lower(fun: Callable[..., Any], name: str, call: _Call,
           platforms: Optional[tuple[str, ...]] = None) -> tuple[Any, _Output, Any]:
    """Trace `fun` once for `call`, check it, and lower a replay of the traced program
    with memory-kind-aware input and output shardings (for `platforms`, default the
    arguments' own: `gpu_plan` lowers for `("cuda",)` with CPU arguments). Returns the
    lowering, how to rebuild its result, and the traced program (a closed jaxpr)."""
    jitted, output = _jitted(fun, name, call)
    traced = jitted.trace(*call.leaves)
    if platforms is None:
        return traced.lower(), output, traced.jaxpr
    return traced.lower(lowering_platforms=platforms), output, traced.jaxpr


def _jitted(fun: Callable[..., Any], name: str, call: _Call) -> tuple[Any, _Output]:
    """Trace `fun` once for `call`, check it, and return a `jax.jit` of a replay of the
    traced program with memory-kind-aware input and output shardings."""
    array_positions = [i for i, a in enumerate(call.is_array) if a]
    outputs: list[Any] = []

    def flat_fun(*dynamic_leaves: Any) -> list[Any]:
        full = list(call.all_leaves)
        for i, x in zip(array_positions, dynamic_leaves, strict=True):
            full[i] = x
        args, kwargs = jtu.tree_unflatten(call.treedef, full)
        keyed_out, out_treedef = jtu.tree_flatten_with_path(fun(*args, **kwargs))
        positions = [i for i, (_, x) in enumerate(keyed_out) if eqx.is_array(x)]
        out_leaves = [None if eqx.is_array(x) else x for _, x in keyed_out]
        outputs[:] = [_Output(out_treedef, out_leaves, positions),
                      [path_parts(keyed_out[i][0]) for i in positions]]
        return [keyed_out[i][1] for i in positions]

    streamed: list[str] = []
    token = _STREAMED.set(streamed)
    late_token = _LATE_PARAMS.set({})
    try:
        traced = jax.jit(flat_fun, in_shardings=call.in_shardings).trace(*call.leaves)
    finally:
        _LATE_PARAMS.reset(late_token)
        _STREAMED.reset(token)
    closed = traced.jaxpr
    _check_no_host_compute(closed.jaxpr, name)
    output, out_paths = outputs
    # An argument's path without the leading args/kwargs index: `(0, ...)` is the
    # first positional argument, as `(0, ...)` is the first element of a tuple result.
    keyed_in = jtu.tree_flatten_with_path(jtu.tree_unflatten(call.treedef, call.all_leaves))[0]
    in_paths = [path_parts(keyed_in[i][0][1:]) for i in array_positions]
    constraints = {
        eqn.outvars[0]: eqn.params["sharding"] for eqn in closed.jaxpr.eqns
        if eqn.primitive.name == "sharding_constraint" and not eqn.params.get("unconstrained_dims")
    }
    out_shardings = output_shardings(
        closed.out_avals, out_paths, [jax.typeof(x) for x in call.leaves], in_paths,
        call.in_shardings, [constraints.get(v) if is_var(v) else None for v in closed.jaxpr.outvars],
    )

    def replay(*dynamic_leaves: Any) -> list[Any]:
        return evaluate(closed.jaxpr, closed.consts, dynamic_leaves)

    # JAX names the executable (and its compile events, `jax.monitoring`) after this.
    replay.__name__ = replay.__qualname__ = getattr(fun, "__name__", "fun")

    jitted = jax.jit(replay, in_shardings=call.in_shardings, out_shardings=out_shardings,
                     donate_argnums=call.donated)
    output.streamed = "streamed" in streamed
    output.prefetched = "prefetched" in streamed
    output.whole = "whole" in streamed
    return jitted, output


def _run(executable: Any, output: _Output, call: _Call, silence: bool) -> Any:
    with warnings.catch_warnings():
        if silence:
            warnings.filterwarnings("ignore", message=_UNUSABLE_DONATION)
        flat_out = executable(*call.leaves)
    for i, x in call.retyped.items():
        if i in call.donated:  # the copy was donated: consume the original as donation would
            x.delete()
    for x in call.shared.values():  # a copy was donated in its place (`_unshare`)
        if not x.is_deleted() and all(
                x is not y for y in call.leaves):  # (kept where it was not donated)
            x.delete()
    return output.rebuild(flat_out)


class Compiled:
    """A compiled `filter_jit` function for one configuration of arguments (returned by
    `filter_jit(f).lower(...).compile()`). Call it with arguments of the same structure,
    static values, shapes, dtypes and shardings as those it was lowered for."""

    def __init__(self, executable: Any, output: _Output, key: Any, donate: _Donation,
                 name: str) -> None:
        self._executable = executable
        self._output = output
        self._key = key
        self._donate = donate
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = _flatten_call(args, kwargs, self._donate, name=self._name)
        if call.key != self._key:
            raise SignatureError(
                f"filter_jit({self._name}).lower(...).compile(): called with arguments "
                "that differ from those it was lowered for (tree structure, static "
                "values, shapes, dtypes or shardings). Lower it again for these "
                "arguments, or call the `filter_jit` function itself (it compiles once "
                "per configuration)."
            )
        return _run(self._executable, self._output, call, self._donate.silence)

    def memory_analysis(self) -> Any:
        """XLA's memory analysis of the executable (`jax.stages.Compiled.memory_analysis`)."""
        return self._executable.memory_analysis()

    def cost_analysis(self) -> Any:
        """XLA's cost analysis of the executable (`jax.stages.Compiled.cost_analysis`)."""
        return self._executable.cost_analysis()

    def as_text(self) -> Optional[str]:
        """The compiled program as text (`jax.stages.Compiled.as_text`)."""
        text: Optional[str] = self._executable.as_text()
        return text


class Lowered:
    """A `filter_jit` function lowered for one configuration of arguments (returned by
    `filter_jit(f).lower(...)`), as `eqx.filter_jit(f).lower(...)`."""

    def __init__(self, lowered: Any, output: _Output, key: Any, donate: _Donation, name: str,
                 default_options: Optional[dict[str, Any]] = None, jaxpr: Any = None) -> None:
        self._lowered = lowered
        self._jaxpr = jaxpr  # the traced program (`gpu_plan` counts its flops)
        self._output = output
        self._key = key
        self._donate = donate
        self._name = name
        self._default_options = dict(default_options or {})

    def compile(self, compiler_options: Optional[dict[str, Any]] = None) -> Compiled:
        """Compiles it, with XLA `compiler_options` for this executable alone (e.g. the
        GPU scheduler's settings; see the "Modes" docs page). They are added to
        `filter_jit`'s defaults (for a GPU step that holds arrays in host memory, the
        scheduler's limit on copies in flight; see the "GPU plan" docs page), and win
        over them."""
        options = {**self._default_options, **(compiler_options or {})}
        with warnings.catch_warnings():
            if self._donate.silence:
                warnings.filterwarnings("ignore", message=_UNUSABLE_DONATION)
            executable = self._lowered.compile(options or None)
        return Compiled(executable, self._output, self._key, self._donate, self._name)

    def as_text(self) -> str:
        """The lowered program (StableHLO) as text."""
        text: str = self._lowered.as_text()
        return text


class _FilterJit(Generic[_P, _T]):
    """What `filter_jit` returns: call it, or `.lower(...)` it."""

    def __init__(self, fun: Callable[_P, _T], donate: _Donation,
                 compiler_options: Optional[dict[str, Any]]) -> None:
        self._fun = fun
        self._donate = donate
        self._compiler_options = compiler_options
        self._name = getattr(fun, "__qualname__", repr(fun))
        self._cache: dict[Any, Compiled] = {}
        self._warned = False  # `_warn_changed_number`, once per function
        functools.update_wrapper(self, fun)

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        call = _flatten_call(args, kwargs, self._donate, name=self._name)
        compiled = self._cache.get(call.key)
        if compiled is None:
            if not self._warned and self._cache:
                self._warned = _warn_changed_number(self._cache, call, self._donate, self._name)
            compiled = self._lower_call(call).compile(self._compiler_options)
            self._cache[call.key] = compiled
        out: _T = _run(compiled._executable, compiled._output, call,
                       self._donate.silence)
        return out

    def lower(self, *args: _P.args, **kwargs: _P.kwargs) -> Lowered:
        """Lowers the function for these arguments without running it (ahead-of-time
        compilation). `.compile()` on the result gives a callable `Compiled` with
        `memory_analysis()`, `cost_analysis()` and `as_text()`. The function's call
        cache is not touched."""
        return self._lower_call(_flatten_call(args, kwargs, self._donate, name=self._name))

    def export(self, platforms: Optional[Sequence[str]] = None) -> Callable[..., Any]:
        """`jax.export.export` for this function, memory kinds kept: returns a callable
        that takes the function's arguments and returns a `jax.export.Exported` lowered
        for `platforms` (default: the default backend), with the input and output
        shardings `filter_jit` compiles with. The exported program takes and returns
        the offloaded state in host memory and contains its copies to and from the
        device, for CUDA too. (Exporting `jax.jit(step)` with specs built from the
        state's own shardings drops the memory kinds: its program never copies the
        state to the device; see the "Export" docs page.)

        The `Exported` takes the distinct array leaves of `(args, kwargs)`, in
        `jax.tree.leaves` order, and returns the array leaves of the result.

        !!! Example

            ```python
            import jax.numpy as jnp
            import optax
            import eqx_offload

            params = {"w": jnp.ones((4, 4))}
            opt = eqx_offload.offloaded(optax.adam(1e-3))
            state = opt.init(params)

            @eqx_offload.filter_jit
            def step(params, state):
                updates, state = opt.update(params, state, params)
                return optax.apply_updates(params, updates), state

            exported = step.export(platforms=["cuda"])(params, state)
            assert "annotate_device_placement" in exported.mlir_module()
            ```
        """

        def export(*args: Any, **kwargs: Any) -> Any:
            call = _flatten_call(args, kwargs, self._donate, name=self._name)
            with warnings.catch_warnings():
                if self._donate.silence:
                    warnings.filterwarnings("ignore", message=_UNUSABLE_DONATION)
                # Traced for the platform exported for: `offloaded`'s default streams
                # for an accelerator even when exported from a CPU machine.
                with compiling_for(platforms[0] if platforms else jax.default_backend()):
                    jitted, _ = _jitted(self._fun, self._name, call)
                specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                         for x, s in zip(call.leaves, call.in_shardings, strict=True)]
                return jax.export.export(jitted, platforms=platforms)(*specs)

        return export

    def _lower_call(self, call: _Call, platforms: Optional[tuple[str, ...]] = None) -> Lowered:
        with warnings.catch_warnings():
            if self._donate.silence:
                warnings.filterwarnings("ignore", message=_UNUSABLE_DONATION)
            lowered, output, jaxpr = _lower(self._fun, self._name, call, platforms)
        platform = platforms[0] if platforms else _platform_of(call)
        return Lowered(lowered, output, call.key, self._donate, self._name,
                       default_compiler_options(platform, output.streamed, output.prefetched,
                                                output.whole), jaxpr)

    def __get__(self, instance: Any, owner: Any) -> Any:
        # As a method: bind the instance like a function would.
        if instance is None:
            return self
        return functools.partial(self, instance)


@overload
def filter_jit(
    *, donate: Union[Donate, tuple[str, ...]] = "none", compiler_options: Optional[dict[str, Any]] = None
) -> Callable[[Callable[_P, _T]], _FilterJit[_P, _T]]: ...


@overload
def filter_jit(
    fun: Callable[_P, _T], *, donate: Union[Donate, tuple[str, ...]] = "none",
    compiler_options: Optional[dict[str, Any]] = None,
) -> _FilterJit[_P, _T]: ...


def filter_jit(
    fun: Optional[Callable[..., Any]] = None,
    *,
    donate: Union[Donate, tuple[str, ...]] = "none",
    compiler_options: Optional[dict[str, Any]] = None,
) -> Any:
    """A drop-in for `eqx.filter_jit` that is safe to donate host-resident state to.

    All JAX and NumPy arrays in the arguments are traced, everything else is static
    (as `eqx.filter_jit`). Unlike `eqx.filter_jit`, it hands `jax.jit` input *and*
    output shardings that carry memory kinds, so JAX pairs each donated input only with
    an output in the same memory: a `pinned_host` optimizer state can never be aliased
    to a device output (which aborts the process, see the docs' "donation trap").

    It compiles once per configuration (tree structure, static values, shapes, dtypes,
    shardings and memory kinds): committed and uncommitted arguments of the same
    sharding share one executable. `f.lower(*args, **kwargs)` lowers ahead of time, as
    `eqx.filter_jit(f).lower(...)`: `.compile()` returns a callable with
    `memory_analysis()`. `f.export(platforms=[...])(*args)` exports it with
    `jax.export`, memory kinds and copies kept (see the "Export" docs page).

    An array that stands at several donated leaves (`eqx.nn.State(model)` shares the
    model's arrays) is donated once: the other places get a copy for that call, so the
    call runs where `eqx.filter_jit` fails ("Attempt to donate the same buffer twice"),
    and the executable is the same whatever is shared.

    **Arguments:**

    - `fun`: a pure function.
    - `donate`: as `eqx.filter_jit`: `"all"`, `"all-except-first"`, `"warn"`,
        `"warn-except-first"` or `"none"` (default). `"all"` and
        `"all-except-first"` silence JAX's warning about donated buffers it could not
        reuse; the `"warn"` modes keep it. Or a tuple of parameter names (as
        `jax.jit`'s `donate_argnames`): those arguments are donated, the others not,
        e.g. `donate=("discriminator", "opt_state")` for a step that reads a second
        model it does not return (Equinox's DCGAN: `donate="all"` would consume it).
        An array that an earlier donating call consumed raises `DonationError` naming
        its argument and leaf, where JAX says "Array has been deleted".
    - `compiler_options`: XLA options for this function's executables alone (as
        `jax.jit(f).lower(...).compile(compiler_options=...)`), e.g. the GPU
        latency-hiding scheduler's (see the "Modes" docs page). Default `None`. For a
        GPU step that streams an `offloaded` state (its default), `filter_jit` adds
        two options of its own, which these override: XLA's scheduler's limit on
        copies in flight (`xla_gpu_experimental_parallel_async_compute_limit=32`,
        XLA's default 2) and `xla_gpu_dot_merger_threshold_mb=0`; for one that brings
        such a state whole (`group_bytes=None`),
        `xla_gpu_enable_analytical_sol_latency_estimator=False`, so its copies do not
        all start before the forward pass (see the "GPU plan" docs page). On the CPU it adds
        nothing.

    **Returns:**

    The compiled version of `fun` (with `.lower`).

    **Raises:**

    `OptionError` for an unknown `donate` (or a name that is not a parameter of
    `fun`). `DonationError` for an argument that an earlier donating call deleted.
    `CompositionError` at the first call if `fun` computes on a host-resident array
    (anything but moving it, placing it, or passing it through a call, `cond`, `while`
    or `scan`) outside `compute_on(..., compute_type="device_host")`: on a GPU, XLA
    would run that on the host or refuse to compile it. The usual cause is a
    combinator that computes on the state of what it wraps placed around `offloaded`,
    such as `optax.MultiSteps(offloaded(...))`; the message names the operation, where
    it is, and the fix for that kind of operation.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import optax
        import eqx_offload

        model = eqx.nn.Linear(4, 4, key=jax.random.key(0))
        opt = eqx_offload.offloaded(optax.adamw(1e-3))
        state = opt.init(eqx.filter(model, eqx.is_array))

        @eqx_offload.filter_jit(donate="all")
        def step(model, state, x):
            grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
            updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state

        compiled = step.lower(model, state, jnp.ones(4)).compile()
        print(compiled.memory_analysis())
        model, state = step(model, state, jnp.ones(4))
        ```
    """
    donation = _donation(donate, fun)  # (checked here, also for the decorator form)
    if compiler_options is not None and not isinstance(compiler_options, dict):
        raise OptionError(
            f"filter_jit(compiler_options={compiler_options!r}): compiler_options must be "
            "a dict of XLA option names to values, or None."
        )
    if fun is None:
        return functools.partial(filter_jit, donate=donate, compiler_options=compiler_options)
    return _FilterJit(fun, donation, compiler_options)

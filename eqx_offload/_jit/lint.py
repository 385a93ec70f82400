"""`filter_jit`'s host-compute check: nothing in a traced step computes on a
host-resident array."""

import os
import traceback
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.tree_util as jtu
from jax.extend.core import jaxprs_in_params, Literal

from .._core.compat import memory_space_mismatch, mismatched_operands
from .._core.compat import source_frames
from .._core.errors import CompositionError, host_compute_error, host_value_error
from .._core.errors import host_weights_error
from .._core.leaves import call_argument
from .._core.placement import memory_kind_of
from .provenance import host_operand


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
    # The same bits read as another dtype of the same width (`update_in_backward` carries
    # 8-bit state's uint32 codes as float32 through the backward pass): no computation.
    "bitcast_convert_type",
})
# What usually puts each kind of operation on host-resident state, and the fix.
_SELECT_HINT = (
    "Put the combinator that chooses between the old and the new state inside "
    "`offloaded`: `offloaded(optax.MultiSteps(...))`, not `optax.MultiSteps(offloaded(...))`."
)
_GENERIC_HINT = (
    "Bring what the step reads from the optimizer state to the device first: "
    "`eqx_offload.to_device(x)`, or read it through the `OffloadedState` (`opt_state[0].mu`), "
    "which does; or put the transformation that computes on it inside `offloaded(...)`."
)
_HINTS = {"select_n": _SELECT_HINT, "select_and_scatter_add": _SELECT_HINT}
_JAX_DIR = os.path.dirname(str(jax.__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep


def _where_in_source(eqn: Any) -> str:
    """`" (at file:line in function)"` for the innermost frame outside JAX, or `""`."""
    for file, line, function in source_frames(eqn):
        if not file.startswith(_JAX_DIR):
            return f" (at {file}:{line} in {function})"
    return ""


def _host_compute(jaxpr: Any, enclosing: tuple[Any, ...] = ()) -> Optional[tuple[str, str]]:
    """The first equation, at any depth, that computes on a host-memory value outside
    `compute_on(..., compute_type="device_host")`: its primitive's name and a
    description; `None` if there is none. (`enclosing`: the equations whose
    sub-jaxprs hold `jaxpr`, innermost last; where the equation found has no source of
    its own, the innermost of them that has one names where it is.)"""
    for eqn in jaxpr.eqns:
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
            source = next(filter(None, map(_where_in_source, (eqn, *enclosing[::-1]))), "")
            return eqn.primitive.name, f"`{eqn.primitive.name}` on {operands}{source}"
        for sub in jaxprs_in_params(eqn.params):
            found = _host_compute(sub, (*enclosing, eqn))
            if found is not None:
                return found
    return None


def host_weights_leaf(arguments: Any) -> Optional[str]:
    """The argument and path of the first host-memory array of `arguments` (a call's
    `(args, kwargs)`) that is a field of a module (an attribute on its path) outside an
    optimizer state (an `OffloadedState`'s `inner_state`): a model's weight moved with
    `to_host`, which a step cannot compute on as it is."""
    for path, x in jtu.tree_flatten_with_path(arguments)[0]:
        if memory_kind_of(x) in ("pinned_host", "unpinned_host"):
            found = weight_leaf(path, arguments)
            if found is not None:
                return found
    return None


def _in_a_state(path: Any, arguments: Any) -> bool:
    """Whether `path` into `arguments` passes through a `NamedTuple` (an Optax state,
    such as a `ScheduleFreeState` read without its `OffloadedState`)."""
    node = arguments
    for key in path:
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return True
        try:
            if isinstance(key, jtu.SequenceKey):
                node = node[key.idx]
            elif isinstance(key, jtu.DictKey):
                node = node[key.key]
            elif isinstance(key, jtu.GetAttrKey):
                node = getattr(node, key.name)
            else:
                return False
        except (AttributeError, IndexError, KeyError, TypeError):
            return False
    return False


def weight_leaf(path: Any, arguments: Any) -> Optional[str]:
    """The argument and path of a host-memory leaf at `path` (into a call's `(args,
    kwargs)`, `arguments`) if it is a field of a module outside an optimizer state:
    `"args[0], leaf .blocks.weight"`; else `None`."""
    names = [getattr(k, "name", None) for k in path if isinstance(k, jtu.GetAttrKey)]
    if not names or "inner_state" in names or _in_a_state(path, arguments):
        return None
    argument, leaf = call_argument(path)
    where = f"args[{argument}]" if isinstance(argument, int) else f"`{argument}`"
    return f"{where}, leaf {leaf}"


def _explained(name: str, described: str, hint: str,
               weights: Callable[[], Optional[str]]) -> CompositionError:
    leaf = weights()
    if leaf is None:
        return host_compute_error(f"filter_jit({name})", described, hint)
    return host_weights_error(f"filter_jit({name})", described, leaf)


def check_no_host_compute(jaxpr: Any, name: str,
                          weights: Callable[[], Optional[str]] = lambda: None) -> None:
    """A `CompositionError` where `jaxpr` computes on a host-resident array (naming the
    operation, where it is, and `weights()`, a host weight among the arguments)."""
    found = _host_compute(jaxpr)
    if found is None:
        return
    primitive, described = found
    raise _explained(name, described, _HINTS.get(primitive, _GENERIC_HINT), weights)


def _user_frame(frame: Any) -> bool:
    return not frame.f_code.co_filename.startswith((_JAX_DIR, _PACKAGE_DIR))


def memory_space_error(name: str, error: BaseException,
                       weights: Callable[[], Optional[str]] = lambda: None,
                       argument_of: Callable[[Any], Optional[str]] = lambda _: None,
                       ) -> Optional[CompositionError]:
    """The `CompositionError` for JAX's refusal to trace an operation on a host-resident
    and a device array (`compat.memory_space_mismatch`), naming where in the source it
    is and the host operand (`provenance.host_operand`; `argument_of(tracer)`: the
    step's argument a tracer is): a value the step made (a host weight's gradient), an
    argument, or else `weights()`, a host weight among the arguments
    (`host_weights_leaf`); `None` for any other error, which the caller lets through."""
    primitive = memory_space_mismatch(error)
    if primitive is None:
        return None
    source = ""
    for frame, line in traceback.walk_tb(error.__traceback__):
        if _user_frame(frame):
            source = f" (at {frame.f_code.co_filename}:{line} in {frame.f_code.co_name})"
    operands = mismatched_operands(error)
    described = f"`{primitive}` on {operands}{source}"
    host_type = next((t for t in operands.split(" with ") if "<host>" in t), "")
    operand = host_operand(error, host_type, _user_frame, argument_of)
    if operand is not None and operand.made:
        return host_value_error(f"filter_jit({name})", described, operand.name)
    if operand is not None and operand.argument is not None:
        return host_weights_error(f"filter_jit({name})", described, operand.argument)
    return _explained(name, described, _GENERIC_HINT, weights)

"""`filter_jit`: `eqx.filter_jit` with memory-kind-aware shardings, safe to donate
host-resident state to."""

import functools
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast, Optional, overload, ParamSpec, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jax.extend.core import jaxprs_in_params, Literal

from ._compat import HOST_COMPUTE_NAME
from ._errors import CompositionError
from ._memory import default_device
from ._types import Donate
from ._where import key_to_str


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


def _is_committed(x: Any) -> bool:  # a `jax.ShapeDtypeStruct` with a sharding counts
    # (At module level, not nested in `_input_shardings`: under jaxtyping's import hook a
    # nested function is decorated, i.e. beartype compiles a wrapper, on every call.)
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and (
        x.committed if isinstance(x, jax.Array) else x.sharding is not None
    )


def _input_shardings(leaves: Sequence[Any]) -> list[jax.sharding.Sharding]:
    """The sharding each argument leaf is compiled for.

    A committed `jax.Array` keeps its own. An uncommitted one (e.g. `jnp.ones(3)`) or a
    NumPy array goes where `jax.jit` would put it: replicated over the mesh of the
    committed arguments, or onto their one device, in its own memory kind (a sharded
    model called with a fresh batch must not fail with "incompatible devices")."""
    committed = [x.sharding for x in leaves if _is_committed(x)]
    meshes = [s.mesh for s in committed if isinstance(s, jax.sharding.NamedSharding)]
    devices = {d for s in committed for d in s.device_set}
    result: list[jax.sharding.Sharding] = []
    for leaf in leaves:
        if _is_committed(leaf) or (isinstance(leaf, jax.Array) and not committed):
            result.append(leaf.sharding)
            continue
        kind = leaf.sharding.memory_kind if isinstance(leaf, jax.Array) else None
        if meshes:
            result.append(jax.sharding.NamedSharding(
                meshes[0], jax.sharding.PartitionSpec(), memory_kind=kind))
        elif len(devices) == 1:
            result.append(jax.sharding.SingleDeviceSharding(next(iter(devices)), memory_kind=kind))
        elif isinstance(leaf, jax.Array):
            result.append(leaf.sharding)
        else:
            result.append(jax.sharding.SingleDeviceSharding(default_device()))
    return result


def _memory_kind_of(aval: Any, device: jax.Device) -> str:
    if aval.memory_space == jax.memory.Space.Host:
        return "pinned_host"
    kind: str = device.default_memory().kind  # `jax.Device` is untyped for mypy
    return kind


def _common_suffix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(reversed(a), reversed(b)):
        if x != y:
            break
        n += 1
    return n


def _output_shardings(
    out_avals: Sequence[Any],
    in_avals: Sequence[Any],
    in_shardings: Sequence[Any],
    out_paths: Optional[Sequence[tuple[str, ...]]] = None,
    in_paths: Optional[Sequence[tuple[str, ...]]] = None,
) -> list[jax.sharding.Sharding]:
    """A concrete sharding with the right memory kind for every output.

    The memory kind comes from the traced program (`aval.memory_space`). The layout, in
    order of preference: the sharding an explicit-axes mesh gives the output; the
    sharding of an input of the same shape (a training step returns new params and
    state shaped like the old ones) -- of several, the one whose path in the arguments
    ends like the output's path in the result (`(model, state)` in, `(model, state)`
    out), then one of the same dtype; replicated over the inputs' mesh; the default
    device.

    (An `Auto`-axes mesh gives every traced value an all-`None` spec, so only an
    explicit-axes mesh's spec is trusted: trusting the other would replicate every
    model-parallel output.)
    """
    meshes = [s.mesh for s in in_shardings if isinstance(s, jax.sharding.NamedSharding)]
    mesh = meshes[0] if meshes else None
    if mesh is not None:
        device = mesh.devices.flat[0]
    else:
        devices = [d for s in in_shardings for d in s.device_set]
        device = devices[0] if devices else default_device()
    if in_paths is None:
        in_paths = [()] * len(in_avals)
    if out_paths is None:
        out_paths = [()] * len(out_avals)
    by_shape: dict[Any, list[tuple[Any, tuple[str, ...], jax.sharding.Sharding]]] = {}
    for aval, path, in_sharding in zip(in_avals, in_paths, in_shardings):
        by_shape.setdefault(aval.shape, []).append((aval.dtype, path, in_sharding))
    result = []
    for aval, out_path in zip(out_avals, out_paths):
        kind = _memory_kind_of(aval, device)
        abstract = getattr(aval, "sharding", None)
        candidates = by_shape.get(aval.shape, [])
        like_input = None
        if candidates:
            _, _, best = max(
                candidates,  # of equal keys `max` keeps the first: the earliest input
                key=lambda c: (_common_suffix(c[1], out_path), c[0] == aval.dtype),
            )
            like_input = best.with_memory_kind(kind)
        if (
            mesh is not None
            and isinstance(abstract, jax.sharding.NamedSharding)
            and not abstract.mesh.empty
            and abstract.mesh.axis_names == mesh.axis_names
            and jax.sharding.AxisType.Explicit in abstract.mesh.axis_types
        ):
            sharding: jax.sharding.Sharding = jax.sharding.NamedSharding(
                mesh, abstract.spec, memory_kind=kind
            )
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
            sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
        result.append(sharding)
    return result


# Primitives that may hold or pass along host-resident values without computing on them:
# transfers, and the calls and control flow whose sub-jaxprs are checked in turn (XLA's
# host offloader accepts these on host buffers).
_PASS_THROUGH = frozenset({
    "device_put", "copy", "copy_p", "jit", "pjit", "closed_call", "core_call",
    "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call", "cond", "while",
    "scan", "shard_map", "optimization_barrier",
})
_JAX_DIR = os.path.dirname(str(jax.__file__)) + os.sep


def _where_in_source(eqn: Any) -> str:
    """`" (at file:line in function)"` for the innermost frame outside JAX, or `""`."""
    traceback = getattr(eqn.source_info, "traceback", None)
    for frame in getattr(traceback, "frames", ()):
        if not frame.file_name.startswith(_JAX_DIR):
            return f" (at {frame.file_name}:{frame.line_num} in {frame.function_name})"
    return ""


def _host_compute(jaxpr: Any, outer_source: str = "") -> Optional[str]:
    """The first equation, at any depth, that computes on a host-memory value outside
    `compute_on("device_host")`, described; `None` if there is none. (`outer_source`:
    where the enclosing call is, for equations of a sub-jaxpr that lack their own.)"""
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
            return f"`{eqn.primitive.name}` on {operands}{source}"
        for sub in jaxprs_in_params(eqn.params):
            found = _host_compute(sub, source)
            if found is not None:
                return found
    return None


def _check_no_host_compute(jaxpr: Any, fun: Callable[..., Any]) -> None:
    found = _host_compute(jaxpr)
    if found is None:
        return
    name = getattr(fun, "__qualname__", repr(fun))
    raise CompositionError(
        f"filter_jit({name}): the function computes on host-resident arrays: {found}. "
        "Arrays that `offloaded` keeps in host memory may only be moved, never "
        "computed on: on a GPU, XLA runs such an operation on the host (slowly) or "
        "refuses to compile it. The usual cause is a combinator that computes on the "
        "state of what it wraps, placed around `offloaded`: write "
        "`offloaded(optax.MultiSteps(...))`, not `optax.MultiSteps(offloaded(...))` "
        "(`offloaded` outermost is always safe). To compute on the host on purpose, "
        f"put that code in `{HOST_COMPUTE_NAME}(f, compute_type=\"device_host\", out_memory_spaces=...)`."
    )


def _mistyped_host(leaf: Any) -> bool:
    """A `pinned_host` array whose JAX type says device memory.

    JAX (0.10) types an array assembled from shards with a `SingleDeviceSharding`
    (`jax.make_array_from_single_device_arrays`, `jax.make_array_from_callback`; orbax
    restores that way) as device memory whatever the sharding's memory kind. Traced as it
    is, a host-resident state would be computed on as if it were in device memory;
    `filter_jit` copies such a leaf once, host to host, into a correctly typed array."""
    return (
        isinstance(leaf, jax.Array)
        and leaf.sharding.memory_kind == "pinned_host"
        and jax.typeof(leaf).memory_space != jax.memory.Space.Host
    )


class _Compiled:
    """One compiled configuration: the executable and how to rebuild the output.

    `out_leaves` is the flat output with `None` where the executable's arrays go, in
    the order of `out_positions`; one `tree_unflatten` rebuilds the result."""

    def __init__(
        self, executable: Any, out_treedef: Any, out_leaves: list[Any], out_positions: list[int]
    ) -> None:
        self.executable = executable
        self.out_treedef = out_treedef
        self.out_leaves = out_leaves
        self.out_positions = out_positions


def _static_key(leaves: Sequence[Any], is_array: Sequence[bool]) -> tuple[Any, ...]:
    """The non-array leaves, by value and type (as `eqx.filter_jit`, they must be
    hashable: `1` and `1.0` or `True` must not share an executable)."""
    return tuple((type(x), x) for x, a in zip(leaves, is_array) if not a)


def _filter_jit(fun: Callable[..., Any], donate: str) -> Callable[..., Any]:
    try:
        donate_first, donate_rest, silence = _DONATE_MODES[donate]
    except KeyError:
        raise ValueError(
            f"filter_jit(donate={donate!r}): donate must be one of "
            f"{', '.join(repr(m) for m in _DONATE_MODES)}."
        ) from None
    cache: dict[Any, _Compiled] = {}

    def compile_for(
        all_leaves: list[Any],
        is_array: tuple[bool, ...],
        treedef: Any,
        leaves: list[Any],
        in_shardings: list[jax.sharding.Sharding],
        donated: tuple[int, ...],
    ) -> _Compiled:
        out_parts: list[Any] = []
        out_paths: list[tuple[str, ...]] = []
        array_positions = [i for i, a in enumerate(is_array) if a]

        def flat_fun(*dynamic_leaves: Any) -> list[Any]:
            full = list(all_leaves)
            for i, x in zip(array_positions, dynamic_leaves):
                full[i] = x
            args, kwargs = jtu.tree_unflatten(treedef, full)
            keyed_out, out_treedef = jtu.tree_flatten_with_path(fun(*args, **kwargs))
            positions = [i for i, (_, x) in enumerate(keyed_out) if eqx.is_array(x)]
            out_leaves = [None if eqx.is_array(x) else x for _, x in keyed_out]
            out_parts[:] = [out_treedef, out_leaves, positions]
            out_paths[:] = [tuple(map(key_to_str, keyed_out[i][0])) for i in positions]
            return [keyed_out[i][1] for i in positions]

        traced = jax.jit(flat_fun).trace(*leaves)
        _check_no_host_compute(traced.jaxpr.jaxpr, fun)
        in_avals = [jax.typeof(x) for x in leaves]
        out_avals = traced.jaxpr.out_avals
        # An argument's path without the leading args/kwargs index: `(0, ...)` is the
        # first positional argument, as `(0, ...)` is the first element of a tuple result.
        keyed_in = jtu.tree_flatten_with_path(jtu.tree_unflatten(treedef, all_leaves))[0]
        in_paths = [tuple(map(key_to_str, keyed_in[i][0][1:])) for i in array_positions]
        out_shardings = _output_shardings(out_avals, in_avals, in_shardings, out_paths, in_paths)
        jitted = jax.jit(
            flat_fun,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnums=donated,
        )
        executable = jitted.trace(*leaves).lower().compile()
        return _Compiled(executable, *out_parts)

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # One flatten of the arguments; the first argument's leaves come first.
        all_leaves, treedef = jtu.tree_flatten((args, kwargs))
        is_array = tuple(map(eqx.is_array, all_leaves))
        # Which leaves are the first argument's matters only if it is donated differently.
        first_def: Any = jtu.tree_structure(args[:1])  # `PyTreeDef` is untyped for mypy
        n_first: int = first_def.num_leaves if donate_first != donate_rest else 0
        leaves: list[Any] = []
        donated_list: list[int] = []
        for i, (x, a) in enumerate(zip(all_leaves, is_array)):
            if a:
                if donate_first if i < n_first else donate_rest:
                    donated_list.append(len(leaves))
                leaves.append(x)
        donated = tuple(donated_list)
        retyped = {i: x for i, x in enumerate(leaves) if _mistyped_host(x)}
        for i, x in retyped.items():
            leaves[i] = jax.device_put(x, x.sharding, may_alias=False)
        in_shardings = _input_shardings(leaves)
        key = (
            treedef,
            is_array,
            n_first,
            _static_key(all_leaves, is_array),
            tuple(
                (x.shape, x.dtype, getattr(x, "weak_type", False), sharding)
                for x, sharding in zip(leaves, in_shardings)
            ),
        )
        with warnings.catch_warnings():
            if silence:
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            compiled = cache.get(key)
            if compiled is None:
                compiled = compile_for(all_leaves, is_array, treedef, leaves, in_shardings, donated)
                cache[key] = compiled
            flat_out = compiled.executable(*leaves)
        for i, x in retyped.items():
            if i in donated:  # the copy was donated: consume the original as donation would
                x.delete()
        out_leaves = list(compiled.out_leaves)
        for i, x in zip(compiled.out_positions, flat_out):
            out_leaves[i] = x
        return jtu.tree_unflatten(compiled.out_treedef, out_leaves)

    wrapper._cache_size = lambda: len(cache)  # type: ignore[attr-defined]  # introspection for tests, as jax.jit's
    # The compiled executables, in compilation order (the benchmark reads their
    # `memory_analysis()`).
    wrapper._executables = lambda: [c.executable for c in cache.values()]  # type: ignore[attr-defined]  # introspection for the benchmark
    return wrapper


@overload
def filter_jit(*, donate: Donate = "none") -> Callable[[Callable[_P, _T]], Callable[_P, _T]]: ...


@overload
def filter_jit(fun: Callable[_P, _T], *, donate: Donate = "none") -> Callable[_P, _T]: ...


def filter_jit(fun: Optional[Callable[..., Any]] = None, *, donate: Donate = "none") -> Any:
    """A drop-in for `eqx.filter_jit` that is safe to donate host-resident state to.

    All JAX and NumPy arrays in the arguments are traced, everything else is static
    (as `eqx.filter_jit`). Unlike `eqx.filter_jit`, it hands `jax.jit` input *and*
    output shardings that carry memory kinds, so JAX pairs each donated input only with
    an output in the same memory: a `pinned_host` optimizer state can never be aliased
    to a device output (which aborts the process, see the docs' "donation trap").

    It compiles once per configuration (tree structure, static values, shapes, dtypes,
    shardings and memory kinds): committed and uncommitted arguments of the same
    sharding share one executable.

    **Arguments:**

    - `fun`: a pure function.
    - `donate`: as `eqx.filter_jit`: `"all"`, `"all-except-first"`, `"warn"`,
        `"warn-except-first"` or `"none"` (default). `"all"` and
        `"all-except-first"` silence JAX's warning about donated buffers it could not
        reuse; the `"warn"` modes keep it.

    **Returns:**

    The compiled version of `fun`.

    **Raises:**

    `CompositionError` at the first call if `fun` computes on a host-resident array
    (anything but moving it, passing it through a call, `cond`, `while` or `scan`)
    outside `jax.experimental.compute_on.compute_on("device_host")`: on a GPU, XLA
    would run that on the host or refuse to compile it. The usual cause is a combinator
    that computes on the state of what it wraps placed around `offloaded`, such as
    `optax.MultiSteps(offloaded(...))`; the message names the operation and where it is.

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

        model, state = step(model, state, jnp.ones(4))
        ```
    """
    if fun is None:
        return functools.partial(filter_jit, donate=donate)
    return _filter_jit(fun, donate)

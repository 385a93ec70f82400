"""Start-up where each array lives: `filter_make` makes a model (and its optimizer state)
with every array leaf created directly in the memory it lives in, and `stack_layers`
builds stacked layers so that `filter_make` can make them a layer at a time.

The route (what `filter_make` runs, and what `eqx_offload.planner.plan_startup` plans):

1. `fun` is evaluated abstractly (`filter_eval_shape`): every leaf's shape, dtype and
   memory kind. Evaluated again with each `stack_layers` making one layer, the leaves
   whose leading axis shrinks to 1 are the stacked ones.
2. The other leaves are made in groups (`group_bytes`), one `filter_jit` program per
   group that computes only them (XLA drops the rest of `fun`) and writes each output
   straight into its memory kind.
3. The stacked leaves are allocated once in their memory (zeros made by the host's CPU
   for those in host memory, so they never pass through the device; those of a floating
   type under 32 bits, bf16, made by the device a leaf at a time and moved), then one
   program, compiled once, makes layer `i` of every stacked leaf on the device and
   writes it into the donated buffers, for `i` in `0 .. L - 1`.

So the device holds at most one group, one layer of every stacked leaf, or one stacked
bf16 leaf in host memory, at a time, and no array has two host copies.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Optional, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._core.compat import host_compute
from .._core.errors import OptionError, TreeError
from .._core.leaves import nbytes
from .._core.shape import filter_eval_shape, is_abstract, is_arraylike
from .._jit.jit import filter_jit
from .._jit.stage import layer_being_made, making_layer


_T = TypeVar("_T")
_M = TypeVar("_M")
_HOST = jax.memory.Space.Host
_DOCS = "https://eqx-offload.readthedocs.io/en/latest/models/#start-up"


def stack_layers(make_layer: Callable[[Any], _M], keys: Any) -> _M:
    """Stacked layers, `eqx.filter_vmap(make_layer)(keys)`, that `filter_make` can make
    one layer at a time.

    Outside `filter_make` it is exactly `eqx.filter_vmap(make_layer)(keys)`: every array
    leaf of the result has a leading axis of `L`, the length of `keys`, as
    `scan_layers` runs it. Inside `filter_make`, each program makes one layer
    (`make_layer` of one key, still through `eqx.filter_vmap`, so its values are bitwise
    those of the stack's row), so the device never holds the whole stack.

    **Arguments:**

    - `make_layer`: makes one layer from one row of `keys` (e.g. one PRNG key).
    - `keys`: a pytree whose array leaves share a leading axis of `L` (e.g.
        `jax.random.split(key, L)`).

    **Returns:**

    The stacked layers.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import eqx_offload

        blocks = eqx_offload.stack_layers(lambda k: eqx.nn.Linear(8, 8, key=k),
                                          jax.random.split(jax.random.key(0), 4))
        assert blocks.weight.shape == (4, 8, 8)
        ```
    """
    _check_keys(keys)
    layer = layer_being_made()
    if layer is not None:
        keys = jtu.tree_map(functools.partial(_row, layer), keys)
    stacked: _M = eqx.filter_vmap(make_layer)(keys)
    return stacked


def _check_keys(keys: Any) -> None:
    """Refuses `keys` with a leaf that has no layer axis: one key (`jax.random.key(0)`,
    or the `(2,)` uint32 of `jax.random.PRNGKey(0)`) where one per layer is needed."""
    for leaf in jtu.tree_leaves(keys):
        if not hasattr(leaf, "shape"):  # (`eqx.filter_vmap` passes it to each layer)
            continue
        shape, dtype = leaf.shape, leaf.dtype
        raw_key = shape == (2,) and dtype == jnp.uint32
        if shape == () or raw_key:
            raise OptionError(
                "Pass one key per layer: `stack_layers(make_layer, jax.random.split(key, "
                "L))` for L layers.\nstack_layers(keys=...): got "
                f"{'a raw key (a uint32 of shape (2,))' if raw_key else 'one key (shape ())'}"
                ", which has no layer axis to map over.\n"
                f"See {_DOCS}.")


def _row(layer: jax.Array, x: jax.Array) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, layer, 1)


def _flat_call(fun: Callable[..., Any], indices: Sequence[int], layer: Optional[jax.Array],
               args: Any, kwargs: Any) -> list[Any]:
    """The leaves of `fun(*args, **kwargs)` at `indices` (with `layer`: each
    `stack_layers` making that one layer)."""
    if layer is None:
        out = fun(*args, **kwargs)
    else:
        with making_layer(layer):
            out = fun(*args, **kwargs)
    leaves = jtu.tree_leaves(out)
    return [leaves[i] for i in indices]


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of the start-up route (`filter_make` runs them in order; the start-up
    plan compiles each for its target).

    **Fields:** `what` (for a person); `fun` (a `filter_jit` function); `kind`:
    `"whole"` (makes `indices` whole), `"buffers"` (allocates the stacked leaves at
    `indices`) or `"layers"` (writes layer `i` of each, `layers` times); `indices`
    (leaves of the result); `layers` (how many times it runs).
    """

    what: str
    fun: Any
    kind: str
    indices: tuple[int, ...]
    layers: int = 1
    planned: Any = None  # what a plan compiles in its place (the buffers: one program;
    # a whole group: without the placement on this machine's device)
    parts: tuple[Any, ...] = ()  # the buffers: the programs `fun` calls, each with no argument


@dataclasses.dataclass(frozen=True)
class Route:
    """What `filter_make` will run for `fun(*args, **kwargs)`: the abstract result
    (`jax.ShapeDtypeStruct` leaves with shardings and memory kinds) and the programs."""

    abstract: Any
    programs: tuple[Program, ...]
    dynamic: Any  # the array leaves of `(args, kwargs)`
    static: Any

    @property
    def leaves(self) -> list[Any]:
        return jtu.tree_leaves(self.abstract, is_leaf=is_abstract)


def _stacked(full: Sequence[Any], one: Sequence[Any], group_bytes: int) -> dict[int, int]:
    """Leaf index -> layers, for the leaves whose leading axis is 1 when each
    `stack_layers` makes one layer. A leaf whose shape changes otherwise is made whole,
    if it is at most `group_bytes` (a leaf derived from a stack, such as 8-bit state's
    codes of small stacked leaves, which are kept quantised only where the whole stack
    is large enough); a `TreeError` for a larger one."""
    found = {}
    for i, (a, b) in enumerate(zip(full, one, strict=True)):
        if not is_abstract(a) or a.shape == b.shape:
            continue
        if not (a.ndim == b.ndim >= 1 and b.shape[0] == 1 and a.shape[1:] == b.shape[1:]):
            if nbytes(a) <= group_bytes:
                continue
            raise TreeError(
                f"filter_make: make every stacked leaf with `eqx_offload.stack_layers` "
                f"alone: leaf {i} is {a.shape} for the whole stack but {b.shape} for one "
                f"layer (only the leading axis may change).\nSee {_DOCS}.")
        found[i] = a.shape[0]
    return found


def _groups(indices: Sequence[int], leaves: Sequence[Any], group_bytes: int) -> list[list[int]]:
    groups: list[list[int]] = []
    size = 0
    for i in indices:
        n = nbytes(leaves[i])
        if not groups or size + n > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def route(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
          group_bytes: int = 256 << 20) -> Route:
    """The start-up route of `fun(*args, **kwargs)` (see the module's docstring).
    Traces `fun` twice, compiles nothing."""
    if isinstance(group_bytes, bool) or not isinstance(group_bytes, int) or group_bytes < 0:
        raise OptionError(f"filter_make(group_bytes={group_bytes!r}): pass an int >= 0 "
                          f"(bytes of the leaves one program makes).\nSee {_DOCS}.")
    dynamic, static = eqx.partition((args, kwargs), is_arraylike, is_leaf=is_abstract)
    abstract = filter_eval_shape(fun, *args, **kwargs)
    full = jtu.tree_leaves(abstract, is_leaf=is_abstract)
    one = jtu.tree_leaves(filter_eval_shape(_layered(fun), jnp.int32(0), *args, **kwargs),
                          is_leaf=is_abstract)
    stacked = _stacked(full, one, group_bytes)
    # A stacked vector of a type under 32 bits (a bf16 norm scale) is made whole: a TPU
    # cannot write one row of it into host memory ("On a TPU" in docs/models.md).
    by_layer = {i: n for i, n in stacked.items() if full[i].ndim >= 3 or (
        full[i].ndim == 2 and full[i].dtype.itemsize >= 4)}
    whole = [i for i, x in enumerate(full) if is_abstract(x) and i not in by_layer]
    programs = [Program(f"leaves {g}", _whole_program(fun, static, g, [full[i] for i in g]),
                        "whole", tuple(g), planned=_whole_program(fun, static, g))
                for g in _groups(whole, full, group_bytes)]
    for n in sorted(set(by_layer.values())):
        indices = tuple(i for i, m in by_layer.items() if m == n)
        buffers = [full[i] for i in indices]
        fun_of_buffers, parts = _buffers_program(buffers)
        programs.append(Program(f"buffers of {len(indices)} stacked leaves", fun_of_buffers,
                                "buffers", indices, planned=_buffers_plan(buffers), parts=parts))
        programs.append(Program(f"{n} layers of {len(indices)} stacked leaves",
                                _layers_program(fun, static, indices), "layers", indices, n))
    return Route(abstract, tuple(programs), dynamic, static)


def _layered(fun: Callable[..., _T]) -> Callable[..., _T]:
    def one_layer(layer: jax.Array, *args: Any, **kwargs: Any) -> _T:
        with making_layer(layer):
            return fun(*args, **kwargs)
    return one_layer


def _whole_program(fun: Callable[..., Any], static: Any, indices: Sequence[int],
                   likes: Optional[Sequence[Any]] = None) -> Any:
    """The program that makes the leaves at `indices` whole. With `likes` (their
    `filter_eval_shape` leaves), each one-device host leaf is placed with its sharding
    there (a one-device mesh, which a step compiled from it expects; a `filter_jit`
    output would have its device's); without (a plan, for another device), as it is."""
    def whole(layer: jax.Array, dynamic: Any) -> list[Any]:
        del layer  # (an argument for every program: it names the device to plan on)
        args, kwargs = eqx.combine(dynamic, static)
        made = _flat_call(fun, indices, None, args, kwargs)
        if likes is None:
            return made
        return [_placed(x, like) if _on_host(like) and len(like.sharding.device_set) == 1
                else x for x, like in zip(made, likes, strict=True)]
    return filter_jit(whole)


def _on_host(x: Any) -> bool:
    return getattr(x.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host")


def _zeros(x: Any) -> jax.Array:
    return jnp.zeros(x.shape, x.dtype)


def _narrow(x: Any) -> bool:
    """A floating dtype under 32 bits (bf16): the host's CPU makes its zeros through a
    temporary as large as the leaf, which a TPU runtime's host allocator keeps resident
    after it is freed; the device makes those (one leaf a program) and moves them."""
    dtype = jnp.dtype(x.dtype)
    return bool(jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4)


def _placed(made: jax.Array, like: Any) -> jax.Array:
    """`made` with the sharding of `like`, a leaf of `filter_eval_shape`'s result (a
    program with no inputs would otherwise give its output the default device's)."""
    placed: jax.Array = jax.lax.with_sharding_constraint(made, like.sharding)
    return placed


def _buffers_program(leaves: Sequence[Any]) -> tuple[Any, tuple[Any, ...]]:
    """Zeros of each leaf's shape in its memory: those in host memory made by the
    host's CPU (`compute_on("device_host")`), so no byte of them is on the device, but
    for `_narrow` ones; one program a leaf (on a TPU, a program of several host outputs
    held a temporary of about one more output in host memory, which the runtime's host
    allocator keeps), compiled once for the leaves of one shape, dtype and sharding."""
    host = [_on_host(x) for x in leaves]
    device = [x for x, h in zip(leaves, host, strict=True) if not h]
    on_device = filter_jit(lambda: [_placed(_zeros(x), x) for x in device])
    programs = {x: _host_program(x) for x, h in zip(leaves, host, strict=True) if h}

    def buffers(layer: jax.Array, dynamic: Any) -> list[Any]:
        del layer, dynamic
        made = iter(on_device() if device else [])
        return [programs[x]() if h else next(made) for x, h in zip(leaves, host, strict=True)]
    return buffers, (*([on_device] if device else []), *programs.values())


def _buffers_plan(leaves: Sequence[Any]) -> Any:
    """`_buffers_program` as one program, for a plan: the same outputs in the same
    memories, made where it makes them (the host's own temporaries are not in a
    TPU plan)."""
    host = [_on_host(x) and not _narrow(x) for x in leaves]

    def buffers(layer: jax.Array, dynamic: Any) -> list[Any]:
        del layer, dynamic
        on_host = [x for x, h in zip(leaves, host, strict=True) if h]
        made = iter(host_compute(lambda: [_zeros(x) for x in on_host],
                                 compute_type="device_host",
                                 out_memory_spaces=[_HOST] * len(on_host))()
                    if on_host else [])
        return [next(made) if h else jax.device_put(_zeros(x), _HOST) if _on_host(x)
                else _zeros(x) for x, h in zip(leaves, host, strict=True)]
    return filter_jit(buffers)


def _host_program(x: Any) -> Any:
    """The program that makes zeros of `x` in host memory, on the host's CPU (on the
    device, and moved, if `_narrow`)."""
    made = (lambda: jax.device_put(_zeros(x), _HOST)) if _narrow(x) else host_compute(
        lambda: _zeros(x), compute_type="device_host", out_memory_spaces=_HOST)
    return filter_jit(lambda: _placed(made(), x))


def _layers_program(fun: Callable[..., Any], static: Any, indices: Sequence[int]) -> Any:
    def write(buffers: list[Any], layer: jax.Array, dynamic: Any) -> list[Any]:
        args, kwargs = eqx.combine(dynamic, static)
        rows = _flat_call(fun, indices, layer, args, kwargs)
        return [jax.lax.dynamic_update_slice_in_dim(b, r, layer, 0)
                for b, r in zip(buffers, rows, strict=True)]
    return filter_jit(write, donate=("buffers",))


def compile_route(made: Route) -> None:
    """Compile each program of a route for this machine's devices, running none (JAX's
    persistent compilation cache, when on, keeps them for a later `filter_make`)."""
    zero = jnp.int32(0)
    for program in made.programs:
        if program.kind == "buffers":
            for part in program.parts:
                part.lower().compile()
        elif program.kind == "whole":
            program.fun.lower(zero, made.dynamic).compile()
        else:  # (its buffers: the abstract leaves, each with its sharding)
            buffers = [made.leaves[i] for i in program.indices]
            program.fun.lower(buffers, zero, made.dynamic).compile()


def run(made: Route) -> Any:
    """Run the programs of a route: the result of `fun`, each leaf made where it lives."""
    leaves = list(made.leaves)
    zero = jnp.int32(0)
    buffers: list[Any] = []
    for program in made.programs:
        if program.kind == "buffers":  # (the layers' program, next, writes into them)
            buffers = program.fun(zero, made.dynamic)
            continue
        if program.kind == "whole":
            outs = program.fun(zero, made.dynamic)
        else:
            for i in range(program.layers):
                buffers = program.fun(buffers, jnp.int32(i), made.dynamic)
            outs = buffers
            buffers = []
        for i, x in zip(program.indices, outs, strict=True):
            leaves[i] = x
    return jtu.tree_unflatten(jtu.tree_structure(made.abstract, is_leaf=is_abstract), leaves)


def _check_fun(fun: Any) -> None:
    """Refuses a `fun` that is not a function that makes the result: a model already
    made (a module with array leaves, callable as a layer), or no callable at all."""
    made = isinstance(fun, eqx.Module) and any(
        is_arraylike(x) for x in jtu.tree_leaves(fun, is_leaf=is_abstract))
    if made or not callable(fun):
        what = f"a {type(fun).__name__}" + (" with array leaves (a model already made)"
                                           if made else ", which is not callable")
        raise OptionError(
            "Pass the function that makes the model, not the model: "
            "`filter_make(lambda key: Model(key), key)`.\n"
            f"filter_make(fun=...): got {what}.\n"
            f"See {_DOCS}.")


def filter_make(fun: Callable[..., _T], *args: Any, group_bytes: int = 256 << 20,
                compile_only: bool = False, **kwargs: Any) -> _T:
    """`fun(*args, **kwargs)`, every array leaf of the result made directly in the memory
    it lives in: the sibling of `eqx.filter_eval_shape` that allocates.

    Make a large model, and its optimizer state, without ever holding the whole model
    on the device or two host copies of one array: `fun` builds the model (its stacked
    layers with `eqx_offload.stack_layers`), moves what lives in host memory there
    (`eqx_offload.to_host`) and may `init` any wrapper (`master_weights`, `offloaded`,
    `host_weights_optimizer`). Only the leaves of the result are made: an fp32 model
    that `master_weights(...).init` turns into bf16 weights and fp32 master weights is
    never made itself. Each group of leaves (at most `group_bytes`) is computed on the
    device by a program of its own and written straight into its memory kind; stacked
    leaves are allocated once where they live (zeros in host memory made by the host's
    CPU, a bf16 leaf's by the device) and written a layer at a time. The values are
    bitwise those of `eqx.filter_jit(fun)(*args, **kwargs)`: each program is compiled,
    and XLA may round a compiled computation (`jax.random.normal(key, shape) * 0.02`)
    otherwise than the same operations run one at a time by an eager call of `fun`.
    What the route holds on the device, planned for a TPU or GPU:
    `eqx_offload.planner.plan_startup`.

    **Arguments:**

    - `fun`: a pure function returning any pytree (a model, `(model, state)`).
    - `*args`, `**kwargs`: its arguments (arrays are traced, the rest static).
    - `group_bytes`: the bytes of the unstacked leaves one program makes (default
        256 MiB): the device holds about this much, and what computing it needs.
    - `compile_only`: compile every program of the route and allocate nothing: the
        result is `filter_eval_shape`'s. With JAX's persistent compilation cache on,
        a later process's `filter_make` of the same model reads them from it (compile
        in a process of its own first: docs/startup.md).

    **Returns:**

    `fun(*args, **kwargs)`, computed as `eqx.filter_jit(fun)(*args, **kwargs)`, each
    array leaf with the sharding and memory kind that
    `eqx_offload.checkpoint.filter_eval_shape(fun, *args, **kwargs)` gives it (so a step
    compiled ahead of time from that takes the result as it is).

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import optax
        import eqx_offload

        def start(key):
            kb, kh = jax.random.split(key)
            model = {"blocks": eqx_offload.stack_layers(
                         lambda k: eqx.nn.Linear(64, 64, key=k), jax.random.split(kb, 8)),
                     "head": eqx.nn.Linear(64, 1, key=kh)}
            model["blocks"] = eqx_offload.to_host(model["blocks"])
            mw = eqx_offload.master_weights(optax.adamw(1e-3))
            return mw.init(model)

        model, state = eqx_offload.filter_make(start, jax.random.key(0))
        assert model["blocks"].weight.sharding.memory_kind == "pinned_host"
        master = state.inner_state.master["blocks"].weight
        assert master.sharding.memory_kind == "pinned_host"
        ```
    """
    _check_fun(fun)
    made = route(fun, args, kwargs, group_bytes=group_bytes)
    if compile_only:
        compile_route(made)
        abstract: _T = made.abstract
        return abstract
    result: _T = run(made)
    return result

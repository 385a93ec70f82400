"""The one staging path of a `filter_jit` call (`stage`): trace the function once for
the call's arguments, analyse the traced program (`analysis.analyse`), and give a
`jax.jit` of a replay of it with memory-kind-aware input and output shardings (so JAX
pairs a donated input only with an output in the same memory). Calling, `lower`,
`lower_for` and `export` all start here; `run` runs an executable on a call."""

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, Optional

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.extend.core import jaxpr_as_fun

from .._core.leaves import path_parts
from .._core.placement import output_shardings
from .._core.target import lowering_for
from .analysis import analyse
from .call import _Call, _Output
from .donation import _UNUSABLE_DONATION
from .lint import host_weights_leaf, memory_space_error


@dataclasses.dataclass(frozen=True)
class Staged:
    """A call staged: the `jax.jit` of the replay, how to rebuild its result, and the
    traced program (a closed jaxpr)."""

    jitted: Any
    output: _Output
    jaxpr: Any

    def lower(self, call: _Call, platforms: Optional[tuple[str, ...]] = None) -> Any:
        """The replay lowered for `call` (for `platforms`, default the arguments' own:
        `gpu_plan` lowers for `("cuda",)` with CPU arguments)."""
        traced = self.jitted.trace(*call.leaves)
        if platforms is None:
            return traced.lower()
        return traced.lower(lowering_platforms=platforms)


def _flat_fun(fun: Callable[..., Any], call: _Call, outputs: list[Any]) -> Callable[..., Any]:
    """`fun` on the call's array leaves alone (the static ones are `call`'s); records how
    to rebuild the result and the output paths in `outputs` when traced."""
    array_positions = [i for i, a in enumerate(call.is_array) if a]

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

    return flat_fun


def stage(fun: Callable[..., Any], name: str, call: _Call, platforms: tuple[str, ...]) -> Staged:
    """Trace `fun` once for `call`, to be lowered for `platforms` (what `offloaded`'s
    default update reads: `target.lowering_platforms`), analyse the program, and stage
    a replay of it with memory-kind-aware input and output shardings."""
    outputs: list[Any] = []
    weights = lambda: host_weights_leaf(jtu.tree_unflatten(call.treedef, call.all_leaves))  # noqa: E731
    try:
        with lowering_for(platforms):
            traced = jax.jit(_flat_fun(fun, call, outputs),
                             in_shardings=call.in_shardings).trace(*call.leaves)
    except ValueError as error:  # JAX's "memory_space of all inputs ... must be the same"
        explained = memory_space_error(name, error, weights)
        if explained is None:
            raise
        raise explained from error
    closed = traced.jaxpr
    found = analyse(closed, name, weights)
    output, out_paths = outputs
    # An argument's path without the leading args/kwargs index: `(0, ...)` is the
    # first positional argument, as `(0, ...)` is the first element of a tuple result.
    array_positions = [i for i, a in enumerate(call.is_array) if a]
    keyed_in = jtu.tree_flatten_with_path(jtu.tree_unflatten(call.treedef, call.all_leaves))[0]
    in_paths = [path_parts(keyed_in[i][0][1:]) for i in array_positions]
    out_shardings = output_shardings(
        closed.out_avals, out_paths, [jax.typeof(x) for x in call.leaves], in_paths,
        call.in_shardings, list(found.out_constraints),
    )
    as_fun = jaxpr_as_fun(closed)  # (JAX's own evaluator: `jax.core.eval_jaxpr`)

    def replay(*dynamic_leaves: Any) -> list[Any]:
        return list(as_fun(*dynamic_leaves))

    # JAX names the executable (and its compile events, `jax.monitoring`) after this.
    replay.__name__ = replay.__qualname__ = getattr(fun, "__name__", "fun")
    jitted = jax.jit(replay, in_shardings=call.in_shardings, out_shardings=out_shardings,
                     donate_argnums=call.donated)
    output.streamed, output.prefetched, output.whole = (
        found.streamed, found.prefetched, found.whole)
    return Staged(jitted, output, closed)


def run(executable: Any, output: _Output, call: _Call, silence: bool) -> Any:
    """Run a compiled executable on `call`'s array leaves and rebuild the result;
    consume what donation would have consumed (retyped and unshared copies)."""
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

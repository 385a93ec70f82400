"""`scan_layers`: stacked layers run by `jax.lax.scan`, each layer's weights in host
memory brought to the device only while that layer computes.

By default the scan prefetches: while layer `i` computes, layer `i + 1`'s weights come
to the device (a custom VJP does the same downwards in the backward pass, which
recomputes each layer). What the prefetch frees and how its copies overlap on a GPU is
on the models docs page (`docs/models.md`, "Stacked layers").
"""

from collections.abc import Callable
from typing import Any, Optional, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.ad_checkpoint import checkpoint_name

from .._core.compat import marked
from .._core.errors import CompositionError, docs_link, OptionError, see
from .._core.placement import any_on_host, is_host, stacked_packed_vector
from .._stream import hook_for, layer_scan, offload_input as _offload_input, update_scan
from .params import fetch
from .remat import in_a_scan, LAYER_INPUT, offload_names, Policy, union


_M = TypeVar("_M")
_C = TypeVar("_C")
# What `jax.vmap` over the stacked layers themselves (an ensemble) gets, in the scan that
# prefetches and in the update inside the backward pass.
_BATCHED = (
    "scan_layers(prefetch=True): `jax.vmap` maps over the stacked layers themselves (an "
    "ensemble) with weights in host memory; the prefetch would slice and stack them "
    "across the batch in host memory. Pass prefetch=False, or vmap over the inputs only.")
_BATCHED_UPDATE = (
    "Call `jax.vmap` over the inputs only: the update inside the backward pass updates "
    "one stack of layers and one state, not a batch of them.")


def _name_layer_input(x: Any) -> Any:
    return checkpoint_name(x, LAYER_INPUT)


def _call_layer(layer: Any, x: Any) -> Any:
    return layer(x)


def scan_layers(
    layers: _M,
    x: _C,
    call: Callable[[_M, _C], _C] = _call_layer,
    *,
    policy: Optional[Policy] = None,
    offload_input: bool = False,
    unroll: int = 1,
    prefetch: bool = True,
    accumulate: Optional[Any] = None,
) -> _C:
    """Runs stacked layers one after the other, each with its weights brought to the
    device only while it computes.

    `layers` is the Equinox idiom for a stack of identical layers: one module whose
    array leaves have a leading axis of length `L` (e.g.
    `eqx.filter_vmap(make_layer)(jax.random.split(key, L))`). `scan_layers` is
    `jax.lax.scan` over that axis with a rematted body (`jax.checkpoint`), so the
    backward pass recomputes each layer from its input. Weights kept in host memory
    (`eqx_offload.to_host(layers)`) come to the device one layer at a time, in the
    forward pass and again in the backward pass, and their gradients go back to host
    memory (`pinned_host`). Leaves already on the device are used as they are; host
    leaves whose layers are vectors of a dtype under 32 bits (bf16 norm scales) come to
    the device whole before the scan, as a TPU cannot copy one such row out of host
    memory ("On a TPU" in `docs/models.md`). On the CPU backend every move is a no-op
    and the result is bitwise that of the same rematted scan without the moves.

    By default (`prefetch=True`) layer `i + 1`'s weights come to the device while layer
    `i` computes (layer `i - 1`'s in the backward pass), which holds one more layer of
    weights on the device. On a GPU a layer's fetches run side by side only with
    `xla_gpu_experimental_parallel_async_compute_limit=32`, which
    `eqx_offload.filter_jit` compiles such a step with by default (with `jax.jit`, pass
    it to `.lower(...).compile(...)`); why, and what it frees: "Stacked layers" in
    `docs/models.md`. Under `jax.vmap` (the model called per example) the layer is
    batched inside the scan, so each weight gradient is one sum, as without offload.

    **Arguments:**

    - `layers`: the stacked layers (any pytree whose array leaves share a leading axis).
    - `x`: the input of the first layer (the carry: any pytree).
    - `call`: `call(layer, x) -> x`, one layer's computation (default `layer(x)`). Close
        over anything else a layer needs (a mask, positions).
    - `policy`: the remat policy of the layer body (default `None`: save nothing,
        recompute the layer in the backward pass). Use `eqx_offload.remat.offload_names`,
        `offload_regex` or `offload_dots` to keep named activations in host memory.
        A policy that saves everything would keep the fetched weights on the device.
    - `offload_input`: keep each layer's input (the residual stream) in host memory
        for the backward pass instead of on the device: the body names it
        `eqx_offload.remat.LAYER_INPUT` and the policy offloads that name. (An input, or a
        value `policy` offloads, that is a vector of a dtype under 32 bits stays on the
        device: "On a TPU" in `docs/models.md`.)
    - `unroll`: as `jax.lax.scan` (with weights in host memory, `unroll=2` does not
        compile for XLA's GPU target: see `docs/models.md`).
    - `prefetch`: bring layer `i + 1`'s host weights to the device while layer `i`
        computes (default `True`; used when some leaf is in host memory, `policy` is
        `None` and there is more than one layer). `False`: fetch each layer in its own
        iteration.
    - `accumulate`: a running gradient sum of the layers (the structure of
        `eqx.filter(layers, eqx.is_array)`, each leaf of its layer leaf's shape and
        dtype, on the device), or `None`. Given, the gradient that differentiating
        this call returns for `layers` is `accumulate` plus this call's gradient,
        added layer by layer in the backward scan (in place where `accumulate` is
        donated or a loop's carry): gradient accumulation without a second
        whole-model gradient buffer; each addition is `sum + gradient` in the sum's
        dtype (rounded once, not twice, where XLA folds it into the product that makes
        the gradient: `docs/models.md`). Every leaf of `layers` must be an inexact
        array on the device, and `policy` `None`; `accumulate` is not differentiated.

    **Returns:**

    The output of the last layer.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqx_offload

        layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(
            jax.random.split(jax.random.key(0), 4))
        layers = eqx_offload.to_host(layers)

        def loss(layers, x):
            return jnp.sum(eqx_offload.scan_layers(layers, x) ** 2)

        grads = jax.jit(jax.grad(loss))(layers, jnp.ones(8))
        assert grads.weight.sharding.memory_kind == "pinned_host"
        ```
    """
    if not isinstance(offload_input, bool):
        raise OptionError(f"scan_layers(offload_input={offload_input!r}): pass True or False.")
    if not isinstance(prefetch, bool):
        raise OptionError(f"scan_layers(prefetch={prefetch!r}): pass True or False.")
    dynamic, static = eqx.partition(layers, eqx.is_array)
    hook = hook_for(jtu.tree_leaves(dynamic))
    save_input = _offload_input if offload_input else None
    if hook is not None:  # inside `update_in_backward(...).step`, on the layers it updates
        # (stacked: `update_in_backward` checked these very leaves, `_check_stacked` below)
        if policy is not None or accumulate is not None:
            raise OptionError(
                "scan_layers: pass policy=None and accumulate=None inside "
                "update_in_backward(...).step (its backward pass recomputes each layer; a "
                "gradient sum goes to `step(..., accumulated=...)`).\n"
                f"See {docs_link('models.md', 'the-update-inside-the-backward-pass')}.")
        hooked: _C = update_scan(_fetch_packed_vectors(dynamic), static, x, call, hook,
                                 save_input, unroll, _BATCHED_UPDATE)
        return hooked
    _check_stacked(dynamic)
    dynamic = _fetch_packed_vectors(dynamic)
    if accumulate is not None:
        acc = _check_accumulate(dynamic, accumulate, policy)
        fused: _C = layer_scan(dynamic, static, x, call, save_input, unroll, _BATCHED, acc)
        return fused
    if prefetch and policy is None and _has_a_next_layer(dynamic):
        with marked("prefetched"):  # filter_jit's GPU default: the copy limit
            prefetched: _C = layer_scan(dynamic, static, x, call, save_input, unroll, _BATCHED)
        return prefetched
    if offload_input:
        policy = union(offload_names(LAYER_INPUT), policy)
    policy = in_a_scan(policy)

    def layer_body(carry: Any, layer_arrays: Any) -> Any:
        if offload_input:
            carry = jtu.tree_map(_name_layer_input, carry)
        layer = eqx.combine(fetch(layer_arrays), static)
        return call(layer, carry)

    rematted = jax.checkpoint(layer_body, policy=policy)

    def body(carry: Any, layer_arrays: Any) -> tuple[Any, None]:
        return rematted(carry, layer_arrays), None

    out, _ = jax.lax.scan(body, x, dynamic, unroll=unroll)
    result: _C = out
    return result


def _check_stacked(dynamic: Any) -> None:
    """A `CompositionError` where the array leaves of the layers do not share a leading
    axis (a module that is not a stack of layers; JAX would say "scan got values with
    different leading axis sizes")."""
    keyed = jtu.tree_flatten_with_path(dynamic)[0]
    first: dict[Optional[int], str] = {}  # each leading size, and the first leaf with it
    for path, a in keyed:
        first.setdefault(a.shape[0] if a.ndim else None, jtu.keystr(path) or "<root>")
    if keyed and len(first) == 1 and None not in first:
        return
    shown = ", ".join(f"{p} has {n if n is not None else 'none'}" for n, p in
                      list(first.items())[:3])
    raise CompositionError(
        "Stack the layers first: `eqx.filter_vmap(make_layer)(jax.random.split(key, L))` "
        "builds one module whose array leaves have a leading axis of length L.\n"
        "scan_layers(layers): the array leaves do not share a leading axis (the layer "
        f"index): {shown or 'no array leaves'}.\n" + see("not-a-stack-of-layers"))


def _has_a_next_layer(dynamic: Any) -> bool:
    """Whether the prefetch has anything to do: some leaf in host memory, and more than
    one layer. (One layer has no next one; prefetching it anyway would make both passes
    loops of one step, which XLA inlines and fuses otherwise than the plain scan's, so
    the result would not be bitwise that of `prefetch=False`.)"""
    leaves = jtu.tree_leaves(dynamic)
    return any_on_host(leaves) and leaves[0].shape[0] > 1


def _fetch_packed_vectors(dynamic: Any) -> Any:
    """`dynamic` with each `stacked_packed_vector` leaf brought to the device whole, before
    the scan: a TPU tiles the two minor axes of an array and packs 2 (bf16) or 4 (int8,
    fp8) elements of the second-minor one into one 32-bit word, so it cannot copy one
    row of an `(L, D)` bf16 array out of host memory (XLA:TPU: "Sublane slicing size
    must be multiple of element packing factor"), nor write one row of its gradient
    back. These leaves (norm scales, biases) are small; their gradients go to host
    memory whole (JAX transposes the move). Matrices (`ndim >= 3`) are sliced along a
    major axis, which any dtype allows. One move per leaf: under differentiation, one
    move of several leaves would mark an integer leaf as differentiated."""
    def one(a: Any) -> Any:
        return fetch(a) if stacked_packed_vector(a) else a
    return jtu.tree_map(one, dynamic)


def _check_accumulate(dynamic: Any, accumulate: Any, policy: Optional[Policy]) -> list[Any]:
    """`accumulate`'s leaves, checked against the layers' (`dynamic`)."""
    fix = "scan_layers(accumulate=...): "
    if policy is not None:
        raise OptionError(fix + "pass policy=None (the sum is made in scan_layers' own "
                          "backward scan, which recomputes each layer).")
    leaves, acc = jtu.tree_leaves(dynamic), eqx.filter(accumulate, eqx.is_array)
    structure: Any = jtu.tree_structure(acc)  # (`PyTreeDef` is untyped for mypy)
    if structure != jtu.tree_structure(dynamic) or any(
            a.shape != b.shape or a.dtype != b.dtype
            for a, b in zip(leaves, jtu.tree_leaves(acc), strict=True)):
        raise OptionError(fix + "pass a sum of the structure of eqx.filter(layers, "
                          "eqx.is_array), each leaf of its layer leaf's shape and dtype.")
    if any_on_host(leaves):
        raise OptionError(
            "Sum the gradients of layers in host memory in the step instead: "
            "`total + eqx_offload.to_device(g)` in the micro-batch scan's carry "
            "(docs/models.md, `accumulate`).\n" + fix + "a gradient JAX returns "
            "for a weight in host memory is in host memory, so it cannot be the sum on "
            "the device; pass accumulate=None, or keep `layers` on the device.")
    if any(not eqx.is_inexact_array(a) or is_host(a) for a in leaves + jtu.tree_leaves(acc)):
        raise OptionError(fix + "every leaf of `layers` and of the sum must be an inexact "
                          "array on the device.")
    return jtu.tree_leaves(acc)

"""Activations in host memory: remat policies in Equinox terms, and the combinator that
applies one.

A remat policy (`jax.checkpoint(f, policy=...)`) decides, for each intermediate value of
`f`, whether the backward pass recomputes it, keeps it on the device, or keeps it in host
memory (`jax.ad_checkpoint.Offloadable`). Values are named in model code with
`jax.ad_checkpoint.checkpoint_name(x, "name")`; the policies here choose them by name
(`offload_names`), by a regular expression over names (`offload_regex`, axlearn's form),
or by JAX's dot-product heuristic (`offload_dots`). `filter_remat` applies a policy to an
Equinox module or function.

On the CPU backend an offloaded value stays in the one RAM, so the program computes
bitwise what the same remat without offload computes; on a GPU, XLA moves it to
`pinned_host` after the forward pass and back before its use in the backward pass.
"""

import dataclasses
import re
from collections.abc import Callable
from typing import Any, cast, Optional, TypeVar, Union

import equinox as eqx
import jax
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

from .._core.errors import OptionError
from .._core.placement import packed_vector


_F = TypeVar("_F", bound=Callable[..., Any])

Policy = Callable[..., Any]
"""A `jax.checkpoint` policy: called with a primitive, its input types and parameters;
returns a bool (save or not), `jax.ad_checkpoint.Saveable`, `Recompute` or an
`Offloadable`."""

LAYER_INPUT = "eqx_offload.layer_input"
"""The name `scan_layers(..., offload_input=True)` gives each layer's input (the
residual stream), which its policy offloads."""

_OFFLOAD = Offloadable(src="device", dst="pinned_host")


def _name_of(prim: Any, params: dict[str, Any]) -> Optional[str]:
    """The name of a `checkpoint_name` value, or `None` for any other primitive."""
    if getattr(prim, "name", None) == "name" and "name" in params:
        return str(params["name"])
    return None


def _check_names(names: tuple[Any, ...], argument: str) -> frozenset[str]:
    for name in names:
        if not isinstance(name, str):
            raise OptionError(
                f"{argument}: {name!r} is not a name; pass the strings given to "
                "`jax.ad_checkpoint.checkpoint_name(x, name)`."
            )
    return frozenset(names)


_Choice = Union[frozenset[str], str, None]
"""Which named values a policy chooses: a set of names, a regular expression that a name
must match in full, or none."""


def _chooses(choice: _Choice, name: str) -> bool:
    if isinstance(choice, frozenset):
        return name in choice
    return choice is not None and re.fullmatch(choice, name) is not None


@dataclasses.dataclass(frozen=True)
class _ByName:
    """Keeps a named value on the device where `save` chooses it, in host memory where
    `offload` does, and recomputes the rest (every unnamed value too)."""

    offload: _Choice
    save: _Choice

    def __call__(self, prim: Any, *_: Any, **params: Any) -> Any:
        name = _name_of(prim, params)
        if name is None:
            return Recompute
        if _chooses(self.save, name):
            return Saveable
        if _chooses(self.offload, name):
            return _OFFLOAD
        return Recompute


def offload_names(*names: str, save: tuple[str, ...] = ()) -> Policy:
    """A remat policy that keeps the values named `names` in host memory for the
    backward pass, keeps those named in `save` on the device, and recomputes the rest
    (JAX's `save_and_offload_only_these_names` from `device` to `pinned_host`).

    **Arguments:**

    - `*names`: names given with `jax.ad_checkpoint.checkpoint_name(x, name)`.
    - `save`: names to keep on the device instead (must not overlap `names`).

    **Returns:**

    A policy for `filter_remat`, `scan_layers` or `jax.checkpoint`.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        from jax.ad_checkpoint import checkpoint_name
        import eqx_offload

        def f(w, x):
            h = checkpoint_name(jnp.tanh(w @ x), "hidden")
            return jnp.sum(jnp.sin(h))

        remat = eqx_offload.filter_remat(f, eqx_offload.remat.offload_names("hidden"))
        g = jax.grad(remat)(jnp.ones((4, 4)), jnp.ones(4))
        ```
    """
    offload = _check_names(names, "offload_names(*names)")
    saved = _check_names(tuple(save), "offload_names(save=...)")
    if offload & saved:
        raise OptionError(
            f"offload_names: {sorted(offload & saved)} both offloaded and saved; a value is "
            "either kept on the device (`save`) or in host memory (`*names`)."
        )
    return _ByName(offload, saved)


def offload_regex(offload: Optional[str], *, save: Optional[str] = None) -> Policy:
    """A remat policy that chooses named values by regular expression (axlearn's
    `save_and_offload_only_these_names_regex`): names that fully match `offload` are
    kept in host memory, names that fully match `save` on the device (`save` wins);
    everything else is recomputed.

    **Arguments:**

    - `offload`: a regular expression over `checkpoint_name` names, or `None`.
    - `save`: a regular expression over names to keep on the device, or `None`.

    **Returns:**

    A policy for `filter_remat`, `scan_layers` or `jax.checkpoint`.

    !!! Example

        ```python
        import eqx_offload
        policy = eqx_offload.remat.offload_regex(r"attention/.*", save=r".*/logits")
        ```
    """
    for argument, regex in (("offload", offload), ("save", save)):
        if regex is None:
            continue
        if not isinstance(regex, str):
            raise OptionError(f"offload_regex({argument}={regex!r}): pass a regular "
                              "expression string or None.")
        try:
            re.compile(regex)
        except re.error as e:
            raise OptionError(f"offload_regex({argument}={regex!r}) is not a valid "
                              f"regular expression: {e}.") from e
    return _ByName(offload, save)


def offload_dots() -> Policy:
    """A remat policy that keeps the results of matrix products without batch
    dimensions (a layer's `x @ W`) in host memory and recomputes everything else:
    JAX's `offload_dot_with_no_batch_dims` from `device` to `pinned_host`. It needs no
    names in the model.

    **Returns:**

    A policy for `filter_remat`, `scan_layers` or `jax.checkpoint`.
    """
    policy: Policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host")
    return policy


@dataclasses.dataclass(frozen=True)
class _Union:
    policies: tuple[Policy, ...]

    def __call__(self, prim: Any, *args: Any, **params: Any) -> Any:
        for policy in self.policies:
            decision = policy(prim, *args, **params)
            if decision is not False and decision is not Recompute:
                return decision
        return Recompute


def union(*policies: Optional[Policy]) -> Optional[Policy]:
    """The policy that, for each value, takes the first decision of `policies` that is
    not "recompute" (`None` entries are skipped; `None` if there are none)."""
    present = tuple(p for p in policies if p is not None)
    if not present:
        return None
    return present[0] if len(present) == 1 else _Union(present)


def _outputs(prim: Any, avals: tuple[Any, ...], params: dict[str, Any]) -> list[Any]:
    """The types of what `prim` makes from `avals` (a named value: its input's)."""
    if _name_of(prim, params) is not None:
        return list(avals)
    out, _ = prim.abstract_eval(*avals, **params)
    return list(out) if prim.multiple_results else [out]


@dataclasses.dataclass(frozen=True)
class _PackedVectorsOnDevice:
    policy: Policy

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> Any:
        decision = self.policy(prim, *avals, **params)
        if isinstance(decision, Offloadable) and any(
                packed_vector(a) for a in _outputs(prim, avals, params)):
            return Saveable
        return decision


def in_a_scan(policy: Optional[Policy]) -> Optional[Policy]:
    """`policy` for the body of a layer scan: a value it offloads that is a
    `packed_vector` is kept on the device instead, since the scan would write each
    layer's row of it into one host array (XLA:TPU stops the process there). Such values
    are one vector per layer: small."""
    return None if policy is None else _PackedVectorsOnDevice(policy)


def filter_remat(fun: _F, policy: Optional[Policy] = None, *, prevent_cse: bool = True) -> _F:
    """`eqx.filter_checkpoint` with a policy: rematerialise `fun` (an Equinox module or
    any function) in the backward pass, keeping what `policy` chooses on the device or
    in host memory.

    Its results and gradients are bitwise those of `eqx.filter_checkpoint(fun,
    policy=policy)`; with an offloading policy on a GPU the offloaded values wait in
    `pinned_host` between the passes.

    **Arguments:**

    - `fun`: a callable pytree (an `eqx.Module`) or a function; its array arguments
        (and a module's array leaves) are differentiated as usual.
    - `policy`: e.g. `offload_names(...)`, `offload_regex(...)`, `offload_dots()`, or
        any `jax.checkpoint_policies` policy. Default `None`: save nothing.
    - `prevent_cse`: as `jax.checkpoint`.

    **Returns:**

    A callable of the same signature (a module, if `fun` is one).
    """
    if policy is not None and not callable(policy):
        raise OptionError(
            f"filter_remat(policy={policy!r}): a policy is a callable, e.g. "
            "`eqx_offload.remat.offload_names('name')` or `jax.checkpoint_policies.nothing_saveable`."
        )
    # (`eqx.filter_checkpoint` is typed with a ParamSpec; a module is a callable of any.)
    return cast(_F, eqx.filter_checkpoint(fun, prevent_cse=prevent_cse, policy=policy))

"""One pass over a step's traced program (`analyse`): what `filter_jit` must know about
it before it compiles, read from the program itself.

- the host-compute lint (`lint.check_no_host_compute`): nothing computes on a
  host-resident array;
- the marked scopes (`compat.scopes`): whether the program streams, prefetches or
  fetches an `offloaded` state whole (the GPU's default options depend on it);
- the sharding constraints on its outputs (`eqx.filter_shard` at the end of a step
  says where an output lives).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

from jax.extend.core import Literal

from .._core.compat import scopes
from .lint import check_no_host_compute


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What `analyse` read from a traced program."""

    streamed: bool
    prefetched: bool
    whole: bool
    out_constraints: tuple[Optional[Any], ...]  # per output: its sharding constraint, or None


def analyse(closed: Any, name: str,
            weights: Callable[[], Optional[str]] = lambda: None) -> Analysis:
    """Check the traced program `closed` (a closed jaxpr) computes on no host-resident
    array (`CompositionError` naming `name`, and `weights()`, a host weight among the
    arguments, otherwise) and read what it marks and constrains."""
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
        out_constraints=tuple(None if isinstance(v, Literal) else constraints.get(v) for v in jaxpr.outvars),
    )

"""The matrix-product flops of a traced step, by the rate they run at, counted in its
jaxpr with every loop iteration: the compute floor of a `Plan` (`docs/gpu-plan.md`).
"""

import importlib
from collections.abc import Mapping
from typing import Any


def _dot_flops(eqn: Any) -> tuple[str, float]:
    import numpy as np

    lhs, rhs = (v.aval for v in eqn.invars[:2])
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    rhs_free = [d for i, d in enumerate(rhs.shape) if i not in rhs_contract and i not in rhs_batch]
    flops = 2.0 * float(np.prod(lhs.shape, dtype=float)) * float(np.prod(rhs_free, dtype=float))
    return _rate_kind(eqn, lhs.dtype), flops


def _conv_flops(eqn: Any) -> tuple[str, float]:
    import numpy as np

    lhs, rhs = (v.aval for v in eqn.invars[:2])
    out = eqn.outvars[0].aval
    # Each output element: a sum over the kernel's spatial window and its input features.
    out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
    per_output = float(np.prod(rhs.shape, dtype=float)) / max(1, out_features)
    return _rate_kind(eqn, lhs.dtype), 2.0 * float(np.prod(out.shape, dtype=float)) * per_output


def _rate_kind(eqn: Any, dtype: Any) -> str:
    import jax
    import numpy as np

    if np.dtype(dtype).itemsize <= 2:
        return "bf16"
    precision = eqn.params.get("precision")
    highest = jax.lax.Precision.HIGHEST
    if precision is not None and any(p == highest for p in (
            precision if isinstance(precision, tuple) else (precision,))):
        return "fp32"
    return "tf32"


def _sub_jaxprs(params: Mapping[str, Any]) -> list[Any]:
    core: Any = importlib.import_module("jax.extend.core")  # not in every checker's stubs
    found: list[Any] = []  # jaxprs
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, core.ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, core.Jaxpr):
                found.append(v)
    return found


def _total(flops: dict[str, float]) -> float:
    return float(sum(flops.values()))


def matmul_flops(jaxpr: Any) -> dict[str, float]:
    """The matrix-product (`dot_general`, convolution) flops of a jaxpr, by the rate
    they run at (`"bf16"`, `"tf32"`, `"fp32"`): every iteration of a `scan`, the
    costlier branch of a `cond`, one iteration of a `while` (its trip count is not
    known), and everything inside calls, custom derivatives and remat (whose
    recomputation is part of the program). Elementwise work is not counted."""
    totals: dict[str, float] = {}

    def add(kind: str, flops: float) -> None:
        totals[kind] = totals.get(kind, 0.0) + flops

    def walk(jaxpr: Any, times: float) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "dot_general":
                kind, flops = _dot_flops(eqn)
                add(kind, flops * times)
            elif name == "conv_general_dilated":
                kind, flops = _conv_flops(eqn)
                add(kind, flops * times)
            elif name == "cond":
                branches = [matmul_flops(b.jaxpr) for b in eqn.params["branches"]]
                costliest: dict[str, float] = max(branches, key=_total, default={})
                for kind, flops in costliest.items():
                    add(kind, flops * times)
            else:
                repeat = float(eqn.params.get("length", 1)) if name == "scan" else 1.0
                for sub in _sub_jaxprs(eqn.params):
                    walk(sub, times * repeat)

    walk(getattr(jaxpr, "jaxpr", jaxpr), 1.0)
    return totals


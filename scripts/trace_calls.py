"""What the package runs in one call of the docs' `update_in_backward` step
(docs/models.md): the lines of its files executed (distinct), the files, and the moves
between files (consecutive lines in two files), measured with `sys.settrace`, for the
first call (trace, compile, run), the cached call and the eager call (the step not
jitted).

    python scripts/trace_calls.py          # JSON: {"first": {...}, "cached": ..., "eager": ...}
    python scripts/trace_calls.py --by-file  # and each call's lines per file, top moves
"""

import collections
import json
import os
import pathlib
import sys
import types
from collections.abc import Callable
from typing import Any, Optional

PACKAGE = str(pathlib.Path(__file__).resolve().parents[1] / "eqx_offload")


def measure(call: Callable[[], Any], package: str = PACKAGE,
            by_file: bool = False) -> dict[str, Any]:
    """`call()` traced: the lines of `package`'s files it runs, the files and the moves;
    `by_file`: also the lines per file and the most frequent moves (`file:function`)."""
    lines: set[tuple[str, int]] = set()
    moves: collections.Counter[tuple[str, str]] = collections.Counter()
    last: Optional[str] = None
    last_at = ""

    def local(frame: types.FrameType, event: str, _: Any) -> Any:
        nonlocal last, last_at
        if event == "line":
            file = frame.f_code.co_filename
            lines.add((file, frame.f_lineno))
            at = f"{file.removeprefix(package + os.sep)}:{frame.f_code.co_name}"
            if last is not None and last != file:
                moves[last_at, at] += 1
            last, last_at = file, at
        return local

    def calls(frame: types.FrameType, event: str, _: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(package) else None

    sys.settrace(calls)
    try:
        call()
    finally:
        sys.settrace(None)
    counts: dict[str, Any] = {"lines": len(lines), "files": len({f for f, _ in lines}),
                              "moves": sum(moves.values())}
    if by_file:
        per_file = collections.Counter(f.removeprefix(package + os.sep) for f, _ in lines)
        counts["by_file"] = dict(per_file.most_common())
        counts["top_moves"] = [f"{n} {a} -> {b}" for (a, b), n in moves.most_common(12)]
    return counts


def main(package: str = PACKAGE, by_file: bool = False) -> dict[str, dict[str, Any]]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_offload

    class Stack(eqx.Module):
        blocks: eqx.nn.Linear
        head: eqx.nn.Linear

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.head(eqx_offload.scan_layers(self.blocks, x))

    keys = jax.random.split(jax.random.key(0), 5)
    stack = Stack(eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(keys[:4]),
                  eqx.nn.Linear(8, 1, key=keys[4]))

    def stack_loss(model: Stack, x: jax.Array) -> jax.Array:
        return jnp.mean(jax.vmap(model)(x) ** 2)

    opt = eqx_offload.update_in_backward(optax.adamw(1e-3), layers=lambda m: m.blocks,
                                         offload=eqx_offload.offloaded)
    made = opt.init(stack)

    @eqx_offload.filter_jit(donate="all")
    def fused_step(model: Stack, state: Any, x: jax.Array) -> Any:
        return opt.step(stack_loss, model, state, x)

    x = jnp.ones((2, 8))
    out: dict[str, Any] = {}
    result: list[Any] = [made]

    def step(fun: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            _, model, state = fun(*result[0], x)
            jax.block_until_ready((model, state))
            result[0] = (model, state)
        return run

    out["first"] = measure(step(fused_step), package, by_file)
    out["cached"] = measure(step(fused_step), package, by_file)
    out["eager"] = measure(step(lambda m, s, x: opt.step(stack_loss, m, s, x)), package, by_file)
    return out


if __name__ == "__main__":
    print(json.dumps(main(by_file="--by-file" in sys.argv[1:])))

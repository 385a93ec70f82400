"""What one eager default `offloaded(...).update` costs in the package's own code: the
functions it runs, their files and lines, and the pytree walks it makes."""

import inspect
import os
import sys
from types import FrameType
from typing import Any

import jax.numpy as jnp
import optax

import eqx_offload


_PACKAGE = os.path.dirname(eqx_offload.__file__) + os.sep
_TREE_MODULES = (os.path.join("jax", "_src", "tree_util.py"), os.path.join("jax", "_src", "tree.py"))
_WALKS = {"tree_flatten", "tree_leaves", "tree_map", "tree_structure", "tree_unflatten",
          "tree_flatten_with_path", "tree_leaves_with_path", "tree_map_with_path",
          "flatten", "leaves", "map", "structure", "unflatten", "flatten_with_path",
          "leaves_with_path", "map_with_path"}


def _ours(frame: Any) -> bool:
    # By the code's file, so that the wrappers jaxtyping's import hook adds (compiled
    # by beartype, with a file name of their own) do not count.
    return frame is not None and frame.f_code.co_filename.startswith(_PACKAGE)


def profile_update(update: Any, *args: Any) -> dict[str, Any]:
    """Run `update(*args)` under `sys.setprofile`: the package's functions it calls,
    their files and total source lines, and the pytree walks made from its code."""
    codes: set[Any] = set()
    walks = [0]

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(_PACKAGE):
                codes.add(code)
            elif (code.co_filename.endswith(_TREE_MODULES) and code.co_name in _WALKS
                  and _ours(frame.f_back)):
                walks[0] += 1
        elif event == "c_call" and _ours(frame) and "flatten" in getattr(arg, "__name__", ""):
            walks[0] += 1  # a `PyTreeDef`/registry method called directly

    sys.setprofile(hook)
    try:
        update(*args)
    finally:
        sys.setprofile(None)
    lines = sum(len(inspect.getsourcelines(code)[0]) for code in codes)
    return {
        "functions": sorted(f"{os.path.basename(c.co_filename)}:{c.co_name}" for c in codes),
        "files": sorted({os.path.basename(c.co_filename) for c in codes}),
        "lines": lines,
        "walks": walks[0],
    }


def test_eager_default_update_is_short() -> None:
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3), "e": jnp.ones((5, 2))}
    grads = {k: 0.5 * v + 0.25 for k, v in params.items()}
    opt = eqx_offload.offloaded(optax.adamw(1e-3))
    state = opt.init(params)
    _, state = opt.update(grads, state, params)  # warm-up: the layout, the first checks
    measured = profile_update(opt.update, grads, state, params)
    print(f"\n{len(measured['functions'])} functions in {len(measured['files'])} files "
          f"({', '.join(measured['files'])}), {measured['lines']} lines, "
          f"{measured['walks']} pytree walks")
    print("\n".join(measured["functions"]))
    assert len(measured["files"]) <= 4
    assert measured["lines"] <= 300
    assert measured["walks"] <= 8


"""Where the `.pyi` stubs shipped with the package are, for the static checkers that need
them (`python -m eqx_offload typings [--mypy]` prints these paths).

The stubs live in `eqx_offload/.typings/`, a hidden folder: pyright and pyrefly skip
hidden folders when they check a project, so the pytype stubs of jax and equinox inside
the package never stand in for the real packages, nor get checked against them.

- `.typings/pytype/`: jax, equinox, jaxtyping and eqx_offload, for pytype, which
  otherwise reads these packages as `Any`.
- `.typings/mypy/`: optax only, which ships no `py.typed`. mypy, pyright and pyrefly read
  the inline types of jax, equinox, jaxtyping and eqx_offload; pytype reads this folder
  too.
"""

import os
import pathlib


_ROOT = pathlib.Path(__file__).resolve().parent / ".typings"


def mypy_path() -> str:
    """The folder to put on mypy's `mypy_path`: the optax stub, and nothing else.

    **Returns:**

    An absolute path (a folder that holds `optax/__init__.pyi`).
    """
    return str(_ROOT / "mypy")


def pytype_path() -> str:
    """The value for pytype's `--pythonpath`: the stubs of jax, equinox, jaxtyping, optax
    and eqx_offload.

    **Returns:**

    Two absolute folders joined by `os.pathsep` (`:` on Linux and macOS), the pytype
    stubs first, then the optax stub that mypy reads too.
    """
    return os.pathsep.join([str(_ROOT / "pytype"), mypy_path()])

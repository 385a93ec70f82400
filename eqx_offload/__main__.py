"""`python -m eqx_offload`: the command line.

    python -m eqx_offload demo     train a model with and without offload, compare bit for bit
    python -m eqx_offload bench    measure step time, memory and transfers side by side
    python -m eqx_offload plan     XLA's plan of a step for an H100/H200, without a GPU
    python -m eqx_offload typings  print the stub folder for pytype's --pythonpath
                                   (--mypy: the folder for mypy's mypy_path)

The demo and the benchmark are `eqx_offload.cli` (public API only, the `cli` extra);
`typings` is here, as it reports where this package keeps its own stubs.
"""

import argparse
import sys
from collections.abc import Sequence
from typing import Optional


_TYPINGS_DESCRIPTION = (
    "Prints the value for `pytype-single --pythonpath=...` (stubs of jax, equinox, "
    "jaxtyping, optax and eqx_offload; two folders joined by the path separator), or "
    "with --mypy the folder for mypy's `mypy_path` (the optax stub only; for an installed "
    "wheel a copy in the user's cache folder, since mypy refuses a path inside "
    "site-packages). pyright and pyrefly need neither.")


def _typings(argv: Sequence[str]) -> int:
    from ._stubs import mypy_path, pytype_path

    parser = argparse.ArgumentParser(prog="eqx_offload typings", description=_TYPINGS_DESCRIPTION)
    parser.add_argument("--mypy", action="store_true",
                        help="print the folder for mypy's mypy_path instead")
    args = parser.parse_args(argv)
    print(mypy_path() if args.mypy else pytype_path())
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m eqx_offload ...` (and the `eqx-offload` console script)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["typings"]:
        return _typings(args[1:])
    from eqx_offload.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())

"""`python -m eqx_offload`: the command line.

    python -m eqx_offload demo     train a model with and without offload, compare bit for bit
    python -m eqx_offload bench    measure step time, memory and transfers side by side
    python -m eqx_offload plan     XLA's plan of a step for an H100/H200, without a GPU
    python -m eqx_offload typings  print the stub folder for pytype's --pythonpath
                                   (--mypy: the folder for mypy's mypy_path)

Every command is `eqx_offload.cli`'s (public API only; the demo and the benchmark need the
`cli` extra); `typings` is run first, without importing the others.
"""

import sys
from collections.abc import Sequence
from typing import Optional


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m eqx_offload ...` (and the `eqx-offload` console script)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["typings"]:  # before the other commands' modules are imported
        from eqx_offload.cli.typings import main as typings

        return typings(args[1:])
    from eqx_offload.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())

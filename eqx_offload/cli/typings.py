"""`python -m eqx_offload typings`: where the package keeps its own stubs.

`eqx_offload.__main__` runs it (`main`) before the other commands' modules are imported
(it needs no JAX program and not the `cli` extra); `eqx_offload.cli.main` lists it in
`--help` and runs it (`run`) as any other command. The one command that reads a private
module: `_stubs`, the shipped stubs' folders, which are packaging, not the library's API."""

import argparse
from collections.abc import Sequence

from eqx_offload._stubs import mypy_path, pytype_path


DESCRIPTION = (
    "Prints the value for `pytype-single --pythonpath=...` (stubs of jax, equinox, "
    "jaxtyping, optax and eqx_offload; two folders joined by the path separator), or "
    "with --mypy the folder for mypy's `mypy_path` (the optax stub only; for an installed "
    "wheel a copy in the user's cache folder, since mypy refuses a path inside "
    "site-packages). pyright and pyrefly need neither.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m eqx_offload typings`."""
    parser.add_argument("--mypy", action="store_true",
                        help="print the folder for mypy's mypy_path instead")


def run(args: argparse.Namespace) -> int:
    """`python -m eqx_offload typings` with its parsed options: prints the folder."""
    print(mypy_path() if args.mypy else pytype_path())
    return 0


def main(argv: Sequence[str]) -> int:
    """`python -m eqx_offload typings ARGV...`, parsed here (`__main__`'s short way)."""
    parser = argparse.ArgumentParser(prog="eqx_offload typings", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))

"""`python -m eqx_offload typings`: where the package keeps its own stubs.

`eqx_offload.__main__` runs it before importing this package (it needs neither JAX nor
the `cli` extra); this entry lists it in `--help` and runs it from `eqx_offload.cli.main`."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m eqx_offload typings`."""
    parser.add_argument("--mypy", action="store_true",
                        help="print the folder for mypy's mypy_path instead")


def run(args: argparse.Namespace) -> int:
    """`python -m eqx_offload typings`, through the command line's entry point (the
    `eqx-offload` console script's)."""
    from eqx_offload.__main__ import main

    return main(["typings", "--mypy"] if args.mypy else ["typings"])

"""Command line: `python -m eqx_offload demo`."""

import argparse
import sys
from collections.abc import Sequence
from typing import Optional


def _demo(args: argparse.Namespace) -> int:
    import jax.numpy as jnp
    import optax

    from . import memory_report, offloaded, to_device

    params = {"w": jnp.ones((512, 512)), "b": jnp.zeros(512)}
    opt = offloaded(optax.adamw(1e-3))
    state = opt.init(params)
    print(memory_report(state))
    back = to_device(state)
    print(memory_report(back))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="eqx_offload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="move an optimizer state to host and back")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())

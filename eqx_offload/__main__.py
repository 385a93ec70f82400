"""The command line of eqx_offload.

    python -m eqx_offload demo    train a model with and without offload, compare bit for bit
    python -m eqx_offload bench   measure step time, memory and mover throughput side by side
    python -m eqx_offload typings print the stub folder for pytype's --pythonpath
                                  (--mypy: the folder for mypy's mypy_path)

(also installed as the `eqx-offload` console script)."""

import argparse
import sys
from collections.abc import Sequence
from typing import Optional


_PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu", "default")


def _select_platform(platform: str) -> None:
    """Must run before JAX initialises a backend."""
    if platform != "default":
        import jax

        jax.config.update("jax_platforms", platform)


def _demo(args: argparse.Namespace) -> int:
    _select_platform(args.platform)
    from ._demo import demo_main, DemoConfig

    config = DemoConfig(
        width=args.width,
        depth=args.depth,
        features=args.features,
        batch=args.batch,
        steps=args.steps,
        optimizer=args.optimizer,
        learning_rate=args.lr,
        seed=args.seed,
        progress=not args.no_progress,
        perturb=args.perturb,
    )
    return demo_main(config, args.json)


def _bench(args: argparse.Namespace) -> int:
    _select_platform(args.platform)
    from ._bench import bench_main, BenchConfig

    config = BenchConfig.quick() if args.quick else BenchConfig.full()
    if args.sizes is not None:
        config = config.replace(sizes=tuple(args.sizes))
    if args.optimizers is not None:
        config = config.replace(optimizers=tuple(args.optimizers))
    if args.modes is not None:
        config = config.replace(modes=tuple(args.modes))
    if args.repeats is not None:
        config = config.replace(repeats=args.repeats)
    if args.batch is not None:
        config = config.replace(batch=args.batch)
    return bench_main(config, args.out, progress=not args.no_progress)


def _bench_modes() -> list[str]:
    from ._bench import MODES

    return list(MODES)


_TYPINGS_HELP = "print where the shipped .pyi stubs are, for pytype or (--mypy) mypy"
_TYPINGS_DESCRIPTION = (
    "Prints the value for `pytype-single --pythonpath=...` (stubs of jax, equinox, "
    "jaxtyping, optax and eqx_offload; two folders joined by the path separator), or "
    "with --mypy the folder for mypy's `mypy_path` (the optax stub only; for an installed "
    "wheel a copy in the user's cache folder, since mypy refuses a path inside "
    "site-packages). pyright and pyrefly need neither.")


def _typings_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mypy", action="store_true",
                        help="print the folder for mypy's mypy_path instead")
    parser.set_defaults(run=_typings)


def _typings(args: argparse.Namespace) -> int:
    from ._stubs import mypy_path, pytype_path

    print(mypy_path() if args.mypy else pytype_path())
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["typings"]:
        # Self-contained: it needs none of the demo's and benchmark's imports.
        parser = argparse.ArgumentParser(prog="eqx_offload typings",
                                         description=_TYPINGS_DESCRIPTION)
        _typings_arguments(parser)
        return _typings(parser.parse_args(argv[1:]))
    from ._demo import OPTIMIZERS

    parser = argparse.ArgumentParser(
        prog="eqx_offload", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="train a small MLP with and without offload; exit 1 unless the losses are "
             "bitwise equal",
        description="Trains a small Equinox MLP on synthetic data twice: plain "
                    "optax.<optimizer> under eqx.filter_jit(donate='all'), and "
                    "offloaded(optax.<optimizer>) under eqx_offload.filter_jit(donate='all'). "
                    "Prints where the bytes live between steps, the median step time and "
                    "the final loss side by side. Exits 1 if the loss trajectories or the "
                    "final parameters are not bitwise equal.")
    demo.add_argument("--width", type=int, default=512, help="hidden width (default 512)")
    demo.add_argument("--depth", type=int, default=4, help="hidden layers (default 4)")
    demo.add_argument("--features", type=int, default=32,
                      help="input and output features (default 32)")
    demo.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    demo.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    demo.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                      help="optax optimizer (default adamw)")
    demo.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--platform", choices=_PLATFORMS, default="cpu",
                      help="JAX platform (default cpu; 'default' lets JAX choose)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    # For the test suite: makes the offloaded run differ, to show that the check fails.
    demo.add_argument("--perturb", action="store_true", help=argparse.SUPPRESS)
    demo.set_defaults(run=_demo)

    bench = sub.add_parser(
        "bench",
        help="benchmark baseline vs the manual pattern vs eqx_offload; write JSON and plots",
        description="Measures, on the same model and data and interleaved: no offload "
                    "(baseline), the manual pattern of JAX's host-offloading tutorial, and "
                    "eqx_offload; over a sweep of model sizes for Adam and Adafactor. Also "
                    "measures the eager movers against a NumPy copy. Writes bench.json, "
                    "bench.md and PNG plots to --out, and states pass/fail per target. "
                    "Runs on whatever backend JAX picks (use --platform cpu to force CPU).")
    bench.add_argument("--quick", action="store_true",
                       help="tiny sizes and few repetitions (seconds; for tests)")
    bench.add_argument("--out", default="bench-out", help="output folder (default bench-out)")
    bench.add_argument("--sizes", type=float, nargs="+", metavar="N",
                       help="parameter counts to sweep (e.g. 1e6 3e7)")
    bench.add_argument("--optimizers", nargs="+", choices=sorted(OPTIMIZERS))
    bench.add_argument("--modes", nargs="+", choices=_bench_modes(),
                       help="modes to measure (default: all; the baseline always runs)")
    bench.add_argument("--repeats", type=int, help="timed steps per configuration")
    bench.add_argument("--batch", type=int, help="batch size")
    bench.add_argument("--platform", choices=_PLATFORMS, default="default",
                       help="JAX platform (default: JAX's choice)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bars")
    bench.set_defaults(run=_bench)

    _typings_arguments(sub.add_parser("typings", help=_TYPINGS_HELP,
                                      description=_TYPINGS_DESCRIPTION))

    args = parser.parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())

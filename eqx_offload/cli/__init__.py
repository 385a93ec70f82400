"""The command line of eqx_offload.

    python -m eqx_offload demo    train a model with and without offload, compare bit for bit
    python -m eqx_offload bench   measure step time, memory and transfers side by side
    python -m eqx_offload bench-host  AdamW's host-compute update on this CPU against a copy
    python -m eqx_offload plan    XLA's GPU plan of a step, compiled without a GPU
    python -m eqx_offload typings the stub folder for pytype (--mypy: for mypy)

(also installed as the `eqx-offload` console script). The demo and the benchmark need
the `cli` extra (`pip install "eqx_offload[cli]"`: rich, tqdm, matplotlib); they use only
the public API of `eqx_offload`, and `import eqx_offload` never imports this package."""

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Optional


_PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu", "default")
EXTRA_HINT = 'pip install "eqx_offload[cli]"'


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand of `python -m eqx_offload`.

    **Fields:**

    - `name`, `help`, `description`: as `argparse` shows them.
    - `module`: the module (relative to this package, or absolute) that defines
        `add_arguments(parser)` and `run(args) -> exit status`; imported only when the
        command line is parsed.
    - `needs`: the packages the command imports that the library does not depend on
        (checked before it runs, with a one-line message naming the extra).
    - `platform`: the default of its `--platform` option (which must take effect
        before JAX starts a backend), or `None` for a command without one. Every
        command that has one runs on the CPU by default (`--platform gpu` or `default`
        for an accelerator): the same command gives the same kind of result on every
        machine, and `plan` compiles for a GPU without one.
    """

    name: str
    help: str
    description: str
    module: str
    needs: tuple[str, ...] = ()
    platform: Optional[str] = None


COMMANDS: list[Command] = [
    Command(
        "demo",
        help="train a small MLP with and without offload; exit 1 unless the losses are "
             "bitwise equal",
        description="Trains a small Equinox MLP on synthetic data twice: plain "
                    "optax.<optimizer> under eqx.filter_jit(donate='all'), and "
                    "offloaded(optax.<optimizer>) under eqx_offload.filter_jit(donate='all'). "
                    "Prints where the bytes live between steps, the median step time, the "
                    "peak device memory (where the backend reports it) and the final loss "
                    "side by side, and what the run shows on its backend (on the CPU, where "
                    "device and host are the same RAM: placement and bitwise equality, no "
                    "saving). Exits 1 if the loss trajectories or the final parameters are "
                    "not bitwise equal, or a state array is not in host memory.",
        module=".demo", needs=("rich", "tqdm"), platform="cpu"),
    Command(
        "bench",
        help="benchmark baseline vs the manual pattern vs eqx_offload, with the bare "
             "copies of the state; write JSON, Markdown and plots",
        description="Measures, on the same model and data and interleaved: no offload "
                    "(baseline), the manual pattern of JAX's host-offloading tutorial, and "
                    "eqx_offload and its modes; on an MLP over a sweep of sizes and on a "
                    "small transformer LM, for Adam and Adafactor; and in the same rotation "
                    "one bare copy of the optimizer state each way (the copy estimate). "
                    "Also measures the eager movers against a NumPy copy, and optionally "
                    "loss curves of a mode against the baseline. Writes bench.json, "
                    "bench.md and PNG plots to --out, and states pass/fail per target. "
                    "Runs on the CPU unless --platform says otherwise.",
        module=".bench", needs=("rich", "tqdm", "matplotlib"), platform="cpu"),
    Command(
        "plan",
        help="XLA's plan of a step for an H100/H200, compiled without a GPU: device peak, "
             "host bytes, copies overlapped",
        description="Compiles the training step for an NVIDIA GPU on this machine, without "
                    "a GPU (eqx_offload.planner.gpu_plan), in the benchmark's modes side by side with "
                    "the step without offload, or your own step (--step MODULE:FUNCTION). "
                    "Prints the device memory at the peak, the host memory, and how many "
                    "copies between host and device XLA schedules under compute. XLA's plan, "
                    "not a measurement. Needs the `plan` extra.",
        module=".plan", platform="cpu"),
    Command(
        "typings",
        help="print the stub folder for pytype's --pythonpath (--mypy: for mypy's mypy_path)",
        description="Prints the folder of the package's stubs for pytype's --pythonpath, or "
                    "with --mypy for mypy's mypy_path.", module=".typings"),
    Command(
        "bench-host",
        help="the host side of compute='host': AdamW's update on this CPU against a NumPy "
             "copy and torch's CPU AdamW; the Modes page's condition with the measured H",
        description="Measures, on this machine, AdamW's update as offloaded(..., "
                    "compute='host') runs it on the CPU backend, plain jax.jit of optax, a "
                    "hand-fused update and torch's CPU AdamW (if torch is installed), in GB/s "
                    "of state touched (28 B a parameter), beside a NumPy copy; then evaluates "
                    "H > 3.5 L for PCIe 4.0, PCIe 5.0 and an H200's link.",
        module=".hostbench", platform="cpu"),
    # Further commands are one more `Command(...)` entry here.
]
"""The subcommands, in the order `--help` lists them."""


def _missing(packages: Sequence[str]) -> list[str]:
    missing = []
    for name in packages:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def _select_platform(platform: str) -> None:
    """Must run before JAX initialises a backend."""
    if platform != "default":
        import jax

        jax.config.update("jax_platforms", platform)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], int]]]:
    parser = argparse.ArgumentParser(
        prog="eqx_offload", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    runners = {}
    for command in COMMANDS:
        module = importlib.import_module(command.module, __name__)
        parser_ = sub.add_parser(command.name, help=command.help,
                                 description=command.description)
        module.add_arguments(parser_)
        if command.platform is not None:
            parser_.add_argument(
                "--platform", choices=_PLATFORMS, default=command.platform,
                help=f"JAX platform (default {command.platform}; gpu for a GPU, 'default' "
                     "lets JAX choose)")
        runners[command.name] = module.run
    return parser, runners


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `python -m eqx_offload` with the arguments `argv` (default: `sys.argv[1:]`).

    **Returns:**

    The exit status: 0 on success, 1 when the command's check fails, 2 for a usage
    error or a missing optional dependency."""
    parser, runners = _parser()
    args = parser.parse_args(argv)
    command = next(c for c in COMMANDS if c.name == args.command)
    missing = _missing(command.needs)
    if missing:
        print(f"eqx_offload {command.name} needs {', '.join(missing)} (the `cli` extra): "
              f"{EXTRA_HINT}", file=sys.stderr)
        return 2
    if command.platform is not None:
        _select_platform(args.platform)
    return runners[command.name](args)

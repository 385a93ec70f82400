"""`python -m eqx_offload demo`: train the same model twice, with and without offload,
and show where the bytes live, what a step costs and that the losses are bitwise equal."""

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_offload

from .measure import ACCELERATOR_RTOL, bitwise_equal, CompileCounter, counting
from .models import make_mlp, make_step, mse_loss, num_params, OPTIMIZERS, regression_batches
from .tables import format_bytes


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Options of `python -m eqx_offload demo` (their defaults are the command line's,
    `add_arguments`)."""

    width: int
    depth: int
    features: int
    batch: int
    steps: int
    optimizer: str
    learning_rate: float
    seed: int
    progress: bool
    perturb: bool


@dataclasses.dataclass
class RunResult:
    """One training run of the demo."""

    label: str
    losses: np.ndarray
    step_seconds: list[float]
    params: eqx_offload.memory.MemoryReport
    opt_state: eqx_offload.memory.MemoryReport
    compilations: int
    final_params: Any = dataclasses.field(repr=False)
    # The process's peak device memory after the run, where the backend reports it
    # (`device.memory_stats()`, None on the CPU). The offloaded run goes first, so its
    # peak is its own; the plain run's is the larger of the two.
    peak_device_bytes: Optional[int] = None

    @property
    def median_step_seconds(self) -> float:
        # The first step compiles; it is not a step time.
        timed = self.step_seconds[1:] or self.step_seconds
        return statistics.median(timed)


def train(
    label: str,
    optimizer: optax.GradientTransformation,
    jit: Callable[[Callable[..., Any]], Callable[..., Any]],
    config: DemoConfig,
) -> RunResult:
    """Train a fresh model for `config.steps` steps and record what the demo shows."""
    from tqdm.auto import tqdm

    model = make_mlp(config.width, config.depth, config.features, config.seed)
    batches = regression_batches(config.features, config.batch, 8, config.seed)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step = jit(make_step(optimizer, mse_loss))
    losses: list[jax.Array] = []
    seconds: list[float] = []
    counter = CompileCounter()
    with counting(counter):
        for i in tqdm(range(config.steps), desc=label, disable=not config.progress,
                      leave=True, unit="step", dynamic_ncols=True):
            start = time.perf_counter()
            model, opt_state, loss = step(model, opt_state, batches[i % len(batches)])
            jax.block_until_ready((model, opt_state, loss))
            seconds.append(time.perf_counter() - start)
            losses.append(loss)
    return RunResult(
        label=label,
        losses=np.asarray(jnp.stack(losses)),
        step_seconds=seconds,
        params=eqx_offload.memory_report(model),
        opt_state=eqx_offload.memory_report(opt_state),
        compilations=counter.count,
        final_params=jax.tree.map(np.asarray, eqx.filter(model, eqx.is_array)),
        peak_device_bytes=peak_device_bytes(),
    )


def peak_device_bytes() -> Optional[int]:
    """The peak bytes in use on the default device so far, where the backend reports
    it (GPU: `peak_bytes_in_use`); `None` where it does not (CPU)."""
    stats = jax.devices()[0].memory_stats()
    peak = (stats or {}).get("peak_bytes_in_use")
    return None if peak is None else int(peak)


@dataclasses.dataclass
class DemoResult:
    """Both runs and the verdict."""

    config: DemoConfig
    plain: RunResult
    offload: RunResult
    losses_equal: bool
    params_equal: bool
    update_equal: bool  # one update from the same gradients, compiled: bitwise
    # The relative tolerance the loss trajectories are held to: `None` (bitwise) on the
    # CPU; on an accelerator XLA compiles the forward and backward passes of two
    # programs differently (docs: "Concepts", bitwise equality).
    rtol: Optional[float] = None

    @property
    def losses_agree(self) -> bool:
        if self.rtol is None:
            return self.losses_equal
        return bool(np.allclose(self.offload.losses, self.plain.losses, rtol=self.rtol,
                                atol=0))

    @property
    def placement_ok(self) -> bool:
        """Between steps, every optimizer-state array of one or more dimensions of the
        offloaded run is in host memory (0-d leaves, the step counter, stay on the
        device under the default `where`)."""
        return all(leaf.memory_kind in ("pinned_host", "unpinned_host")
                   for leaf in self.offload.opt_state.leaves if leaf.shape)

    @property
    def ok(self) -> bool:
        whole_run = self.params_equal if self.rtol is None else True
        return self.update_equal and self.losses_agree and whole_run and self.placement_ok

    def to_json(self) -> dict[str, Any]:
        def run(r: RunResult) -> dict[str, Any]:
            return {
                "label": r.label,
                "params_device_bytes": r.params.device_bytes,
                "params_host_bytes": r.params.host_bytes,
                "opt_state_device_bytes": r.opt_state.device_bytes,
                "opt_state_host_bytes": r.opt_state.host_bytes,
                "opt_state_by_kind": r.opt_state.by_kind,
                "median_step_seconds": r.median_step_seconds,
                "compilations": r.compilations,
                "peak_device_bytes": r.peak_device_bytes,
                "final_loss": float(r.losses[-1]),
                "losses": [float(v) for v in r.losses],
            }

        return {
            "config": dataclasses.asdict(self.config),
            "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind),
            "jax_version": jax.__version__,
            "plain": run(self.plain),
            "offloaded": run(self.offload),
            "update_bitwise_equal": self.update_equal,
            "losses_bitwise_equal": self.losses_equal,
            "losses_rtol": self.rtol,
            "losses_agree": self.losses_agree,
            "final_params_bitwise_equal": self.params_equal,
            "opt_state_placement_ok": self.placement_ok,
        }


def run_demo(config: DemoConfig) -> DemoResult:
    """Train plain `optax.<optimizer>` under `eqx.filter_jit(donate="all")` and
    `offloaded(optax.<optimizer>)` under `eqx_offload.filter_jit(donate="all")` on the
    same model and data, and compare them bit for bit."""
    try:
        factory = OPTIMIZERS[config.optimizer]
    except KeyError:
        raise ValueError(f"optimizer={config.optimizer!r}: choose one of "
                         f"{', '.join(OPTIMIZERS)}.") from None
    name = f"optax.{config.optimizer}"
    # `perturb` exists to show that the comparison can fail: it changes the offloaded
    # run's learning rate by one part in a thousand (a millionth can round away in the
    # float32 losses of a short run: JAX 0.12 on CPU gave equal losses, unequal params).
    lr = config.learning_rate * (1 + 1e-3) if config.perturb else config.learning_rate
    # The offloaded run first: the device's peak memory only grows, so read after it
    # it is that run's own.
    offload = train(f"offloaded({name})", eqx_offload.offloaded(factory(lr)),
                    eqx_offload.filter_jit(donate="all"), config)
    plain = train(name, factory(config.learning_rate), eqx.filter_jit(donate="all"), config)
    return DemoResult(
        config=config,
        plain=plain,
        offload=offload,
        losses_equal=bitwise_equal(plain.losses, offload.losses),
        params_equal=bitwise_equal(plain.final_params, offload.final_params),
        update_equal=update_equal(factory(config.learning_rate), factory(lr), config),
        rtol=None if jax.default_backend() == "cpu" else ACCELERATOR_RTOL,
    )


def update_equal(inner: optax.GradientTransformation, offloaded_inner: optax.GradientTransformation,
                 config: DemoConfig) -> bool:
    """Whether one update from the same gradients, state and parameters, each compiled,
    is bitwise the same with and without offload (on every backend)."""
    model = make_mlp(config.width, config.depth, config.features, config.seed)
    batch = regression_batches(config.features, config.batch, 1, config.seed)[0]
    params = eqx.filter(model, eqx.is_array)
    grads = eqx.filter_jit(eqx.filter_grad(mse_loss))(model, batch)
    offloaded = eqx_offload.offloaded(offloaded_inner)
    want = jax.jit(inner.update)(grads, inner.init(params), params)[0]
    got = eqx_offload.filter_jit(offloaded.update)(grads, offloaded.init(params), params)[0]
    return bitwise_equal(want, got)


def render(result: DemoResult) -> Any:
    """The side-by-side table, as a `rich` renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    plain, off = result.plain, result.offload
    table = Table(title=f"{num_params(plain.final_params):,} parameters, "
                        f"{result.config.steps} steps, backend {jax.default_backend()}")
    table.add_column("between steps")
    table.add_column(plain.label, justify="right")
    table.add_column(off.label, justify="right")
    table.add_row("params: device bytes", format_bytes(plain.params.device_bytes),
                  format_bytes(off.params.device_bytes))
    table.add_row("opt state: device bytes", format_bytes(plain.opt_state.device_bytes),
                  format_bytes(off.opt_state.device_bytes))
    table.add_row("opt state: host bytes", format_bytes(plain.opt_state.host_bytes),
                  format_bytes(off.opt_state.host_bytes))
    table.add_row("device bytes, params + opt state",
                  format_bytes(plain.params.device_bytes + plain.opt_state.device_bytes),
                  format_bytes(off.params.device_bytes + off.opt_state.device_bytes))
    table.add_row("median step time", f"{plain.median_step_seconds * 1e3:.2f} ms",
                  f"{off.median_step_seconds * 1e3:.2f} ms")
    if off.peak_device_bytes is not None and plain.peak_device_bytes is not None:
        table.add_row("peak device memory (process)", format_bytes(plain.peak_device_bytes),
                      format_bytes(off.peak_device_bytes))
    table.add_row("compilations", str(plain.compilations), str(off.compilations))
    table.add_row("final loss", f"{plain.losses[-1]:.8g}", f"{off.losses[-1]:.8g}")
    lines = [Text(line) for line in _what_it_shows(result)] + [
        _verdict("placement", result.placement_ok, None,
                 "every opt-state array of >= 1 dimension in host memory between steps"),
        _verdict("one update from the same gradients", result.update_equal, None),
    ]
    if result.rtol is None:
        lines += [_verdict("loss trajectories", result.losses_equal, len(plain.losses)),
                  _verdict("final parameters", result.params_equal, None)]
    else:
        lines.append(_verdict("loss trajectories", result.losses_agree, len(plain.losses),
                              f"equal to {result.rtol:g} relative"
                              + (" (bitwise)" if result.losses_equal else "")))
    return Group(table, *lines)


def _what_it_shows(result: DemoResult) -> list[str]:
    """What the run proves on this backend, and what is left on the device."""
    plain, off = result.plain, result.offload
    left = [leaf for leaf in off.opt_state.leaves
            if leaf.memory_kind not in ("pinned_host", "unpinned_host")]
    lines = []
    if left:
        names = ", ".join(f"{leaf.path} {leaf.dtype}{list(leaf.shape)}" for leaf in left[:3])
        lines.append(f"left on the device: {format_bytes(sum(x.nbytes for x in left))}, "
                     f"{names}:\n  0-d leaves (the step counter) stay there under the "
                     "default where=min_ndim(1)")
    if jax.default_backend() == "cpu":
        lines.append("on the CPU, device and host memory are the same RAM: nothing is "
                     "saved here;\n  this run shows placement and bitwise equality")
        lines.append("peak device memory: not reported on the CPU (memory_stats() is None)")
        return lines
    freed = plain.opt_state.device_bytes - off.opt_state.device_bytes
    lines.append(f"device memory freed between steps: {format_bytes(freed)} of optimizer "
                 "state")
    if off.peak_device_bytes is None:
        lines.append(f"peak device memory: not reported by the {jax.default_backend()} "
                     "backend (memory_stats() is None)")
    return lines


def _verdict(what: str, ok: bool, steps: Optional[int], claim: str = "bitwise equal") -> Any:
    from rich.text import Text

    count = f" ({steps} steps)" if steps is not None else ""
    if ok:
        return Text(f"{what}{count}: {claim}", style="bold green")
    return Text(f"{what}{count}: NOT {claim}", style="bold red")


def demo_main(config: DemoConfig, json_path: Optional[str] = None) -> int:
    """Run the demo, print the table, write JSON if asked; 0 if every check passes."""
    from rich.console import Console

    result = run_demo(config)
    Console().print(render(result))
    if json_path is not None:
        with open(json_path, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    return 0 if result.ok else 1


# --------------------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m eqx_offload demo`."""
    parser.add_argument("--width", type=int, default=512, help="hidden width (default 512)")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers (default 4)")
    parser.add_argument("--features", type=int, default=32,
                        help="input and output features (default 32)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                        help="optax optimizer (default adamw)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    # For the test suite: makes the offloaded run differ, to show that the check fails.
    parser.add_argument("--perturb", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """`python -m eqx_offload demo`."""
    config = DemoConfig(
        width=args.width, depth=args.depth, features=args.features, batch=args.batch,
        steps=args.steps, optimizer=args.optimizer, learning_rate=args.lr, seed=args.seed,
        progress=not args.no_progress, perturb=args.perturb,
    )
    return demo_main(config, args.json)

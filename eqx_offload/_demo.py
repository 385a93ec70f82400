"""`python -m eqx_offload demo`: train the same model twice, with and without offload,
and show where the bytes live, what a step costs and that the losses are bitwise equal.

Also holds what the benchmark shares with the demo: the model, the data, the training
step, a compilation counter and bitwise comparison."""

import dataclasses
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._jit import filter_jit
from ._optax import offloaded
from ._report import format_bytes, memory_report, MemoryReport


# --------------------------------------------------------------------------- optimizers

OPTIMIZERS: dict[str, Callable[[float], optax.GradientTransformation]] = {
    "adamw": lambda lr: optax.adamw(lr),
    "adam": lambda lr: optax.adam(lr),
    "adafactor": lambda lr: optax.adafactor(lr),
    "lion": lambda lr: optax.lion(lr),
    "sgd": lambda lr: optax.sgd(lr, momentum=0.9),
}
"""The optimizers the demo and the benchmark offer, by name: `name -> factory(lr)`."""


# --------------------------------------------------------------------------- model, data, step

def make_model(width: int, depth: int, features: int, seed: int) -> eqx.nn.MLP:
    """An MLP `features -> width x depth -> features`; `depth` hidden layers."""
    return eqx.nn.MLP(features, features, width, depth, key=jax.random.key(seed))


def num_params(tree: Any) -> int:
    """Number of scalars in the array leaves of `tree`."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def make_data(
    features: int, batch: int, batches: int, seed: int
) -> tuple[jax.Array, jax.Array]:
    """A synthetic regression task: inputs and the outputs of a fixed random teacher
    (a smooth nonlinear map), `batches` batches of `batch` examples."""
    kx, kw = jax.random.split(jax.random.key(seed + 1))
    xs = jax.random.normal(kx, (batches, batch, features))
    teacher = jax.random.normal(kw, (features, features)) / np.sqrt(features)
    ys = jnp.tanh(xs @ teacher)
    return xs, ys


def loss_fn(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error of `model` on one batch."""
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_step(optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    """The (unjitted) training step `(model, opt_state, x, y) -> (model, opt_state, loss)`."""

    def step(model: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


# --------------------------------------------------------------------------- compilations

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_TRACE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    _COMPILE_EVENT,
)
_active: list["CompileCounter"] = []
_lock = threading.Lock()
_registered = [False]


def _on_event(event: str, duration_secs: float, **kwargs: Union[str, int]) -> None:
    if event not in _TRACE_EVENTS:
        return
    with _lock:
        for counter in _active:
            counter.seconds += duration_secs
            if event == _COMPILE_EVENT:
                counter.count += 1


@dataclasses.dataclass
class CompileCounter:
    """Backend compilations (XLA executables built) and the seconds spent tracing,
    lowering and compiling while the counter is active (see `counting`)."""

    count: int = 0
    seconds: float = 0.0


@contextmanager
def counting(counter: CompileCounter) -> Iterator[CompileCounter]:
    """Count the compilations JAX reports (via `jax.monitoring`) into `counter` while
    the block runs. Counters may be nested and reused."""
    if not _registered[0]:
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _registered[0] = True
    with _lock:
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)


# --------------------------------------------------------------------------- bitwise

def bitwise_equal(a: Any, b: Any) -> bool:
    """Whether two pytrees of arrays have the same structure and the same bits in every
    leaf (so `0.0` and `-0.0` differ and two identical NaNs are equal, unlike `==`)."""
    la, ta = jax.tree.flatten(eqx.filter(a, eqx.is_array))
    lb, tb = jax.tree.flatten(eqx.filter(b, eqx.is_array))
    # (Structures compared by their text, which names every node type and key.)
    if str(ta) != str(tb) or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.tobytes() != y.tobytes():
            return False
    return True


# --------------------------------------------------------------------------- demo

@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Options of `python -m eqx_offload demo`."""

    width: int = 512
    depth: int = 4
    features: int = 32
    batch: int = 64
    steps: int = 200
    optimizer: str = "adamw"
    learning_rate: float = 1e-3
    seed: int = 0
    progress: bool = True
    perturb: bool = False


@dataclasses.dataclass
class RunResult:
    """One training run of the demo."""

    label: str
    losses: np.ndarray
    step_seconds: list[float]
    params: MemoryReport
    opt_state: MemoryReport
    compilations: int
    final_params: Any = dataclasses.field(repr=False)

    @property
    def median_step_seconds(self) -> float:
        # The first step compiles; it is not a step time.
        timed = self.step_seconds[1:] or self.step_seconds
        return statistics.median(timed)


def _progress(iterable: range, label: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=label, disable=not enabled, leave=True, unit="step",
                dynamic_ncols=True)


def train(
    label: str,
    optimizer: optax.GradientTransformation,
    jit: Callable[[Callable[..., Any]], Callable[..., Any]],
    config: DemoConfig,
) -> RunResult:
    """Train a fresh model for `config.steps` steps and record what the demo shows."""
    model = make_model(config.width, config.depth, config.features, config.seed)
    xs, ys = make_data(config.features, config.batch, 8, config.seed)
    batches = [(xs[i], ys[i]) for i in range(xs.shape[0])]  # sliced before counting
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step = jit(make_step(optimizer))
    losses: list[jax.Array] = []
    seconds: list[float] = []
    counter = CompileCounter()
    with counting(counter):
        for i in _progress(range(config.steps), label, config.progress):
            x, y = batches[i % len(batches)]
            start = time.perf_counter()
            model, opt_state, loss = step(model, opt_state, x, y)
            jax.block_until_ready((model, opt_state, loss))
            seconds.append(time.perf_counter() - start)
            losses.append(loss)
    return RunResult(
        label=label,
        losses=np.asarray(jnp.stack(losses)),
        step_seconds=seconds,
        params=memory_report(model),
        opt_state=memory_report(opt_state),
        compilations=counter.count,
        final_params=jax.tree.map(np.asarray, eqx.filter(model, eqx.is_array)),
    )


@dataclasses.dataclass
class DemoResult:
    """Both runs and the verdict."""

    config: DemoConfig
    plain: RunResult
    offload: RunResult
    losses_equal: bool
    params_equal: bool

    @property
    def ok(self) -> bool:
        return self.losses_equal and self.params_equal

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
            "losses_bitwise_equal": self.losses_equal,
            "final_params_bitwise_equal": self.params_equal,
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
    plain = train(name, factory(config.learning_rate), eqx.filter_jit(donate="all"), config)
    # `perturb` exists to show that the comparison can fail: it changes the offloaded
    # run's learning rate by one part in a thousand (a millionth can round away in the
    # float32 losses of a short run: JAX 0.12 on CPU gave equal losses, unequal params).
    lr = config.learning_rate * (1 + 1e-3) if config.perturb else config.learning_rate
    offload = train(f"offloaded({name})", offloaded(factory(lr)), filter_jit(donate="all"),
                    config)
    return DemoResult(
        config=config,
        plain=plain,
        offload=offload,
        losses_equal=bitwise_equal(plain.losses, offload.losses),
        params_equal=bitwise_equal(plain.final_params, offload.final_params),
    )


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

    def row(what: str, a: str, b: str) -> None:
        table.add_row(what, a, b)

    row("params: device bytes", format_bytes(plain.params.device_bytes),
        format_bytes(off.params.device_bytes))
    row("opt state: device bytes", format_bytes(plain.opt_state.device_bytes),
        format_bytes(off.opt_state.device_bytes))
    row("opt state: host bytes", format_bytes(plain.opt_state.host_bytes),
        format_bytes(off.opt_state.host_bytes))
    row("device bytes, params + opt state",
        format_bytes(plain.params.device_bytes + plain.opt_state.device_bytes),
        format_bytes(off.params.device_bytes + off.opt_state.device_bytes))
    row("median step time", f"{plain.median_step_seconds * 1e3:.2f} ms",
        f"{off.median_step_seconds * 1e3:.2f} ms")
    row("compilations", str(plain.compilations), str(off.compilations))
    row("final loss", f"{plain.losses[-1]:.8g}", f"{off.losses[-1]:.8g}")

    saved = plain.opt_state.device_bytes - off.opt_state.device_bytes
    total = plain.params.device_bytes + plain.opt_state.device_bytes
    lines = [
        Text(f"device memory saved between steps: {format_bytes(saved)} "
             f"({100 * saved / max(total, 1):.0f}% of params + opt state)"),
        _verdict("loss trajectories", result.losses_equal, len(plain.losses)),
        _verdict("final parameters", result.params_equal, None),
    ]
    return Group(table, *lines)


def _verdict(what: str, ok: bool, steps: Optional[int]) -> Any:
    from rich.text import Text

    count = f" ({steps} steps)" if steps is not None else ""
    if ok:
        return Text(f"{what}{count}: bitwise equal", style="bold green")
    return Text(f"{what}{count}: NOT bitwise equal", style="bold red")


def demo_main(config: DemoConfig, json_path: Optional[str] = None) -> int:
    """Run the demo, print the table, write JSON if asked; 0 if bitwise equal, else 1."""
    from rich.console import Console

    result = run_demo(config)
    Console().print(render(result))
    if json_path is not None:
        with open(json_path, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    return 0 if result.ok else 1

"""The benchmark's modes: one table, `MODES`, from a mode's name to how to build its
training step, with a one-line description. Adding a mode is one entry; a variant of
`offloaded` is `offload_mode("description", option=value)`."""

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_offload

from .measure import CompileCounter, counting
from .models import Loss, make_step


@dataclasses.dataclass
class Runner:
    """One mode of one benchmark point: its jitted step, its live model and state, and
    what its steps measured.

    `compile()` returns the step's compiled executable for the current arguments (for
    its `memory_analysis()`)."""

    mode: str
    step: Callable[..., Any]
    model: Any
    state: Any
    compile: Callable[[Any, Any, Any], Any]
    counter: CompileCounter = dataclasses.field(default_factory=CompileCounter)
    seconds: list[float] = dataclasses.field(default_factory=list)
    cpu_seconds: list[float] = dataclasses.field(default_factory=list)
    losses: list[Any] = dataclasses.field(default_factory=list)
    first_call: float = 0.0

    def run(self, batch: Any) -> tuple[float, float]:
        """One step; returns its wall-clock and process CPU seconds."""
        with counting(self.counter):
            cpu = time.process_time()
            start = time.perf_counter()
            self.model, self.state, loss = self.step(self.model, self.state, batch)
            jax.block_until_ready((self.model, self.state, loss))
            elapsed = time.perf_counter() - start
            cpu = time.process_time() - cpu
        self.losses.append(loss)
        return elapsed, cpu


Build = Callable[[str, optax.GradientTransformation, Any, Loss], Runner]
"""`(mode name, optimizer, fresh model, loss) -> Runner`."""


@dataclasses.dataclass(frozen=True)
class Mode:
    """One column of the benchmark.

    **Fields:**

    - `description`: one line, for `--help` and the docs.
    - `build`: makes the mode's `Runner`.
    - `bitwise`: whether its losses must equal the baseline's bit for bit (a
        correctness check: the run fails if they do not).
    - `default`: measured when `--modes` is not given.
    - `options`: for a mode of `offloaded`, its keyword arguments (so that other
        scripts, such as `bench/results/h200-2026-11-29/gpu_peak.py`, measure the same
        transformation).
    """

    description: str
    build: Build
    bitwise: bool = True
    default: bool = True
    options: Optional[dict[str, Any]] = None


def _baseline(mode: str, optimizer: optax.GradientTransformation, model: Any,
              loss: Loss) -> Runner:
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    # (Any: the stubs type `eqx.filter_jit`'s result as a plain callable, without `lower`.)
    step: Any = eqx.filter_jit(make_step(optimizer, loss), donate="all")

    def compile(model: Any, state: Any, batch: Any) -> Any:
        return step.lower(model, state, batch).compile().compiled

    return Runner(mode, step, model, state, compile)


def _constant(value: Any, _: Any) -> Any:
    return value


def _manual(mode: str, optimizer: optax.GradientTransformation, model: Any,
            loss: Loss) -> Runner:
    """JAX's host-offloading tutorial, on the array part of an Equinox model: the whole
    state in `pinned_host`; inside a plain `jax.jit` the step `device_put`s it to the
    device, updates, and puts it back. The jit gets `in_shardings` and `out_shardings`
    with every leaf's memory kind and donates params and state: with both shardings
    given, JAX pairs donated inputs only with outputs in the same memory."""
    params, static = eqx.partition(model, eqx.is_array)
    on_device = jax.sharding.make_single_device_sharding(jax.devices()[0])
    on_host = on_device.with_memory_kind("pinned_host")
    state = jax.device_put(optimizer.init(params), on_host)
    params = jax.device_put(params, on_device)
    inner = make_step(optimizer, loss)

    def step(params: Any, state: Any, batch: Any) -> Any:
        state = jax.device_put(state, on_device)
        new_model, state, value = inner(eqx.combine(params, static), state, batch)
        state = jax.device_put(state, on_host)
        return eqx.filter(new_model, eqx.is_array), state, value

    params_shardings = jax.tree.map(functools.partial(_constant, on_device), params)
    state_shardings = jax.tree.map(functools.partial(_constant, on_host), state)
    jitted = jax.jit(
        step,
        in_shardings=(params_shardings, state_shardings, on_device),
        out_shardings=(params_shardings, state_shardings, on_device),
        donate_argnums=(0, 1),
    )

    def compile(params: Any, state: Any, batch: Any) -> Any:
        return jitted.lower(params, state, batch).compile()

    return Runner(mode, jitted, params, state, compile)


def offload_mode(description: str, *, bitwise: bool = True, default: bool = True,
             jit_options: Optional[dict[str, Any]] = None, **options: Any) -> Mode:
    """A mode of `offloaded`, for the table `MODES`.

    **Arguments:**

    - `description`, `bitwise`, `default`: as `Mode`'s fields.
    - `jit_options`: extra keyword arguments of `eqx_offload.filter_jit` (e.g.
        `compiler_options`).
    - `options`: keyword arguments of `eqx_offload.offloaded`.

    **Returns:**

    A `Mode` that trains with `eqx_offload.offloaded(optimizer, **options)` under
    `eqx_offload.filter_jit(step, donate="all", **jit_options)`.
    """

    def build(mode: str, optimizer: optax.GradientTransformation, model: Any,
              loss: Loss) -> Runner:
        wrapped = eqx_offload.offloaded(optimizer, **options)
        state = wrapped.init(eqx.filter(model, eqx.is_array))
        step: Any = eqx_offload.filter_jit(make_step(wrapped, loss), donate="all",
                                           **(jit_options or {}))

        def compile(model: Any, state: Any, batch: Any) -> Any:
            return step.lower(model, state, batch).compile()

        return Runner(mode, step, model, state, compile)

    return Mode(description, build, bitwise, default, options)


def _master_weights(mode: str, optimizer: optax.GradientTransformation, model: Any,
                    loss: Loss) -> Runner:
    """bf16 compute weights on the device; fp32 master weights and the state in host
    memory (`eqx_offload.master_weights`, the update streamed one parameter at a time)."""
    mw = eqx_offload.master_weights(
        optimizer, offload=functools.partial(eqx_offload.offloaded, group_bytes=0))
    compute, state = mw.init(model)

    def mixed_loss(model: Any, batch: Any) -> jax.Array:
        cast = jax.tree.map(_to_bfloat16, batch)
        return jnp.asarray(loss(model, cast), jnp.float32)

    def step(model: Any, state: Any, batch: Any) -> Any:
        value, grads = eqx.filter_value_and_grad(mixed_loss)(model, batch)
        return *mw.update(grads, state, model), value

    jitted: Any = eqx_offload.filter_jit(step, donate="all")

    def compile(model: Any, state: Any, batch: Any) -> Any:
        return jitted.lower(model, state, batch).compile()

    return Runner(mode, jitted, compute, state, compile)


def _to_bfloat16(x: Any) -> Any:
    return x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _activations(mode: str, optimizer: optax.GradientTransformation, model: Any,
                 loss: Loss) -> Runner:
    """`offloaded(optimizer)`, the loss rematted with `offload_dots()`: the results of
    the matrix products wait in host memory for the backward pass."""
    wrapped = eqx_offload.offloaded(optimizer)
    state = wrapped.init(eqx.filter(model, eqx.is_array))
    rematted = eqx_offload.filter_remat(loss, eqx_offload.remat.offload_dots())
    step: Any = eqx_offload.filter_jit(make_step(wrapped, rematted), donate="all")

    def compile(model: Any, state: Any, batch: Any) -> Any:
        return step.lower(model, state, batch).compile()

    return Runner(mode, step, model, state, compile)


def _is_linear(x: Any) -> bool:
    return isinstance(x, eqx.nn.Linear)


def _host_weights(mode: str, optimizer: optax.GradientTransformation, model: Any,
                  loss: Loss) -> Runner:
    """Every `eqx.nn.Linear` of the model in host memory (`eqx_offload.host_weights`),
    `host_weights_optimizer(optimizer)` (its state offloaded)."""
    linears = [x for x in jax.tree.leaves(model, is_leaf=_is_linear) if _is_linear(x)]
    model = eqx.tree_at(lambda m: [x for x in jax.tree.leaves(m, is_leaf=_is_linear)
                                   if _is_linear(x)], model,
                        [eqx_offload.host_weights(x) for x in linears])
    hp = eqx_offload.host_weights_optimizer(optimizer)
    state = hp.init(model)

    def step(model: Any, state: Any, batch: Any) -> Any:
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        return (*hp.update(grads, state, model), value)

    jitted: Any = eqx_offload.filter_jit(step, donate="all")

    def compile(model: Any, state: Any, batch: Any) -> Any:
        return jitted.lower(model, state, batch).compile()

    return Runner(mode, jitted, model, state, compile)


MODES: dict[str, Mode] = {
    "baseline": Mode(
        "no offload: the optimizer state on the device, eqx.filter_jit(donate='all')",
        _baseline),
    "manual": Mode(
        "JAX's host-offloading tutorial: the state in pinned_host, device_put in and out "
        "inside jax.jit with full in/out shardings", _manual),
    "eqx_offload": offload_mode(
        "offloaded(optimizer) under eqx_offload.filter_jit(donate='all'): the default, "
        "streamed in automatic groups"),
    "whole_state": offload_mode(
        "offloaded(optimizer, group_bytes=None): the whole state comes to the device at once "
        "(the default before streaming was)", default=False, group_bytes=None),
    "streamed": offload_mode(
        "offloaded(optimizer, group_bytes=0): one parameter's state on the device at a time",
        group_bytes=0),
    "host_compute": offload_mode(
        "offloaded(optimizer, compute='host'): the update runs on the host CPU",
        compute="host"),
    "host_bf16": offload_mode(
        "offloaded(optimizer, host_dtype=jnp.bfloat16): floating state kept in host memory "
        "as bfloat16, half the bytes (not bitwise)",
        bitwise=False, default=False, host_dtype=jnp.bfloat16),
    "master_weights": Mode(
        "master_weights(optimizer): bf16 compute weights, fp32 master weights and state in "
        "host memory, streamed update (not bitwise: bf16)", _master_weights,
        bitwise=False, default=False),
    "activations": Mode(
        "offloaded(optimizer), the loss under filter_remat(offload_dots()): matmul results "
        "wait in host memory for the backward pass (GPU); eqx.filter_jit without donation", _activations,
        bitwise=False, default=False),
    "host_weights": Mode(
        "every eqx.nn.Linear in host memory (host_weights), host_weights_optimizer(...), "
        "apply_updates; eqx.filter_jit without donation", _host_weights,
        bitwise=False, default=False),
}
"""Every mode the benchmark can measure, in the order of its tables. The ratios are to
`baseline`, which always runs."""

DEFAULT_MODES: tuple[str, ...] = tuple(name for name, mode in MODES.items() if mode.default)

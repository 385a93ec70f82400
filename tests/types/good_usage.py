"""An Equinox + optax training script using every public name of `eqx_offload`: it runs, and
mypy --strict, pytype, pyright and pyrefly accept it without an error (tests/test_types.py)."""

import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Float

import eqx_offload
from eqx_offload import Nested
from eqx_offload.types import Compute, Donate, HostMemoryKind, MemoryKind, Where


class Model(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, key: jax.Array) -> None:
        self.mlp = eqx.nn.MLP(4, 2, 16, 2, key=key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.mlp(x)


def loss_fn(model: Model, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


class LargeFloat(eqx_offload.types.Filter):
    """A user-defined path-aware filter: floating-point leaves of at least `n` elements."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, leaf: object, path: str = "") -> bool:
        size = getattr(leaf, "size", 0)
        return isinstance(size, int) and size >= self.n and "count" not in path


def moments_where() -> Where:
    # Filters combine with &, | and ~; a bool and a plain callable are filters too.
    moments = eqx_offload.pattern(r".*/(mu|nu)/.*") & eqx_offload.min_bytes(64)
    never: Callable[[object], bool] = lambda leaf: False  # noqa: E731 - a typed lambda, checked too
    return moments | LargeFloat(1 << 20) | ~eqx_offload.min_ndim(1) & never


def make_optimizer(
    memory_kind: HostMemoryKind = "pinned_host", compute: Compute = "device"
) -> optax.GradientTransformationExtraArgs:
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return eqx_offload.offloaded(inner, moments_where(), memory_kind=memory_kind, compute=compute)


def make_accumulating_optimizer(k: int) -> optax.GradientTransformationExtraArgs:
    # The inner state crosses once per `k` mini-steps; the accumulated gradients stay on host.
    multi = optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=k)
    return eqx_offload.offloaded(multi, accumulator="host")


def as_nested(params: dict[str, jax.Array]) -> Nested[jax.typing.ArrayLike]:
    """Arrays in tuples, lists and dicts, typed as `Nested`. (Not an optax state: pyright and
    pyrefly refuse its `ArrayTree` fields as a `Nested`; pass it to the movers as it is.)"""
    nested: Nested[jax.typing.ArrayLike] = ((params["w"], [params["b"]]), {"lr": 1e-3})
    return nested


def scaled(x: Float[jax.Array, "n 4"], scale: float) -> Float[jax.Array, "n 4"]:
    """A jaxtyping annotation: `Array` to mypy, pyright and pyrefly, `Any` to pytype."""
    return x * scale


def train(steps: int = 3) -> float:
    model = Model(jax.random.key(0))
    params = eqx.filter(model, eqx.is_array)
    opt = make_optimizer()
    state = opt.init(params)
    assert isinstance(state, eqx_offload.OffloadedState)
    inner_state = state.inner_state
    accumulating = make_accumulating_optimizer(2).init(params)
    assert isinstance(accumulating, eqx_offload.OffloadedState)

    donate: Donate = "all"

    @eqx_offload.filter_jit(donate=donate)
    def step(
        model: Model, state: optax.OptState, x: jax.Array, y: jax.Array
    ) -> tuple[Model, optax.OptState, jax.Array]:
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, state, loss

    x = jnp.ones((8, 4))
    y = jnp.zeros((8, 2))
    loss = jnp.zeros(())
    with warnings.catch_warnings():
        warnings.simplefilter("error", eqx_offload.errors.OffloadWarning)
        for _ in range(steps):
            model, state, loss = step(model, state, x, y)

    # Ahead of time: lower, compile, inspect; GPU scheduler options per executable.
    lowered: eqx_offload.types.Lowered = step.lower(model, state, x, y)
    compiled: eqx_offload.types.Compiled = lowered.compile()
    print(compiled.memory_analysis() is not None, len(lowered.as_text()) > 0)
    # Saved as bytes, loaded without tracing (a later process would read them from a file).
    saved: bytes = compiled.serialize()
    loaded: eqx_offload.types.Compiled = step.load(saved)
    print(loaded.memory_analysis() is not None)
    step_options: dict[str, Any] = eqx_offload.stream.prefetch_options(device_bytes=None)
    print(sorted(step_options))

    # Donating by parameter name: what the step returns, not a model it only reads.
    def evaluate(model: Model, state: optax.OptState, x: jax.Array) -> optax.OptState:
        del model, x
        return state

    keep_model = eqx_offload.filter_jit(evaluate, donate=("state",))
    state = keep_model(model, state, x)

    report: eqx_offload.memory.MemoryReport = eqx_offload.memory_report(state)
    largest: eqx_offload.memory.LeafMemory = max(report.leaves, key=lambda leaf: leaf.nbytes)
    print(f"eqx_offload {eqx_offload.__version__}: {report.host_bytes} bytes on host, "
          f"largest leaf {largest.path} ({largest.memory_kind})")
    print(report)

    # The movers, on any pytree; `Where` accepts bools, filters and prefix trees.
    kind: MemoryKind = "pinned_host"
    assert kind in eqx_offload.memory.supported_memory_kinds(jax.devices()[0])
    host_kind: HostMemoryKind = "pinned_host"
    prefix: Where = {"w": True, "b": eqx_offload.min_ndim(1)}
    tree = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    on_host = eqx_offload.to_host(tree, prefix, memory_kind=host_kind)
    placed = eqx_offload.filter_shard(on_host, tree["w"].sharding)  # (the device's memory)
    back = eqx_offload.to_device(placed, where=True)
    assert bool(jnp.array_equal(back["w"], tree["w"]))
    nested = as_nested(tree)
    nested_on_host: Nested[jax.typing.ArrayLike] = eqx_offload.to_host(nested)
    adam = optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=tree, nu=tree)
    adam_on_host: optax.ScaleByAdamState = eqx_offload.to_host((adam,))[0]
    print(eqx_offload.memory_report((nested_on_host, adam_on_host)).host_bytes)
    print(scaled(jnp.ones((2, 4)), 0.5).shape)

    # Offload only what does not fit in a device budget.
    budget_where = eqx_offload.stream.within_budget(optax.adamw(1e-3), tree, device_bytes=64)
    budget_state = eqx_offload.offloaded(optax.adamw(1e-3), budget_where).init(tree)
    print(eqx_offload.memory_report(budget_state).device_bytes)

    # Streaming the update group by group; the plan says what goes together.
    plan: eqx_offload.stream.StreamPlan = eqx_offload.stream.stream_plan(
        optax.adamw(1e-3), tree, optax.adamw(1e-3).init(tree), tree, group_bytes=1 << 10)
    print(len(plan.groups), plan.max_group_nbytes)

    # Checkpoints: restore straight into host memory.
    target = eqx_offload.checkpoint.abstract_init(opt, params)
    shardings = eqx_offload.checkpoint.host_shardings(inner_state, eqx_offload.min_ndim(1))
    like = eqx_offload.checkpoint.restore_target(state)
    with tempfile.TemporaryDirectory() as tmp:
        path = tmp + "/state.eqx"
        eqx.tree_serialise_leaves(path, state)
        spec = eqx_offload.checkpoint.deserialise_filter_spec
        restored = eqx.tree_deserialise_leaves(path, like, filter_spec=spec)
        restored = eqx_offload.checkpoint.tree_deserialise_leaves(path, like)
    print(type(target).__name__, type(shardings).__name__, type(restored).__name__)

    # Every error the library raises is an OffloadError and a ValueError or TypeError.
    try:
        eqx_offload.to_host(tree, where={"not a key of tree": True})
    except (eqx_offload.errors.MemoryKindError, eqx_offload.errors.WhereError, eqx_offload.errors.TracedMoveError,
            eqx_offload.errors.TreeError, eqx_offload.errors.OptionError, eqx_offload.errors.SignatureError,
            eqx_offload.errors.StateError, eqx_offload.errors.NotATransformationError,
            eqx_offload.errors.CompositionError, eqx_offload.errors.CheckpointError,
            eqx_offload.errors.DonationError) as e:
        print("a documented mistake:", e)
    except eqx_offload.OffloadError as e:
        print("other:", e)
    return float(loss)


if __name__ == "__main__":
    # Run time checks on eqx_offload's functions (and on modules named here, imported after).
    eqx_offload.install_runtime_checks()
    print(train())


def plan_the_step(model: Model, x: jax.Array, y: jax.Array) -> bool:
    """XLA's GPU and TPU plans of the step (type-checked here; run in tests/plan/)."""
    optimizer = eqx_offload.offloaded(optax.adamw(1e-3))

    def step(model: Model, state: Any, x: jax.Array, y: jax.Array) -> tuple[Model, Any]:
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    h100: eqx_offload.planner.GpuTarget = eqx_offload.planner.GPU_TARGETS["h100"]
    # The same step planned from shapes: nothing of the model or the state allocated.
    abstract_model = eqx_offload.checkpoint.filter_eval_shape(lambda: model)
    # (`eqx.filter(..., eqx.is_array)` inside: a ShapeDtypeStruct is not an array.)
    def init(model: Model) -> optax.OptState:
        return optimizer.init(eqx.filter(model, eqx.is_array))

    abstract_state = eqx_offload.checkpoint.filter_eval_shape(init, abstract_model)
    try:
        plan: eqx_offload.planner.Plan = eqx_offload.planner.gpu_plan(
            eqx_offload.filter_jit(step, donate="all"), abstract_model, abstract_state,
            x, y, target=h100.with_memory(1 << 30))
        on_tpu: eqx_offload.planner.Plan = eqx_offload.plan(  # (a TPU v5e, through libtpu)
            eqx_offload.filter_jit(step, donate="all"), abstract_model, abstract_state,
            x, y, target="v5e")
    except eqx_offload.errors.PlanError:
        return False
    copies: tuple[eqx_offload.planner.PlannedCopy, ...] = plan.copies_to("to_device")
    collectives: tuple[eqx_offload.planner.PlannedCollective, ...] = plan.collectives
    return plan.fits and on_tpu.fits and all(c.nbytes > 0 for c in copies) and not collectives


class Block(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        self.linear = eqx.nn.Linear(4, 4, key=key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(self.linear(x))


def call_block(block: Block, x: jax.Array) -> jax.Array:
    return block(x)


def models_in_host_memory(key: jax.Array, x: jax.Array) -> jax.Array:
    """Weights, activations and master weights in host memory (type-checked here, run elsewhere)."""
    keys = jax.random.split(key, 3)
    blocks = eqx.filter_vmap(Block)(keys)
    policy: eqx_offload.remat.Policy = eqx_offload.remat.offload_names(eqx_offload.remat.LAYER_INPUT)
    out = eqx_offload.scan_layers(blocks, x, call_block, policy=policy, offload_input=True)
    total = eqx.filter(blocks, eqx.is_array)  # a running gradient sum of the blocks
    out = out + eqx_offload.scan_layers(blocks, x, call_block, accumulate=total)
    head: eqx_offload.types.HostWeights[eqx.nn.Linear] = eqx_offload.host_weights(
        eqx.nn.Linear(4, 4, key=key), policy=eqx_offload.remat.offload_regex(".*"))
    rematted = eqx_offload.filter_remat(call_block, eqx_offload.remat.offload_dots())
    out = rematted(Block(key), out) + head(out)
    hp: eqx_offload.types.HostWeightsOptimizer[Any] = eqx_offload.host_weights_optimizer(optax.adam(1e-3), offload=None)
    head, _ = hp.update(eqx.filter(head, eqx.is_array), hp.init(head), head)
    inner = optax.adam(1e-3)
    updates = jax.tree.map(jnp.zeros_like, eqx.filter(head, eqx.is_array))
    head = eqx_offload.apply_updates(head, updates)
    master: eqx_offload.types.MasterWeights[Any] = eqx_offload.master_weights(inner)
    compute, master_state = master.init(Block(key))
    assert isinstance(master_state, eqx_offload.types.MasterState) or master_state is not None
    result: jax.Array = out + compute(x)
    return result


def jax_jit_step(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """A `jax.jit` program ported to `eqx_offload.jit` (run in test_jax_jit.py)."""

    def apply(params: dict[str, jax.Array], x: jax.Array, scale: float) -> jax.Array:
        return x @ params["w"] * scale

    jitted = eqx_offload.jit(apply, static_argnums=2, donate_argnums=(0,))
    result: jax.Array = jitted(params, x, 2.0)
    return result


def nnx_jit_step(x: jax.Array) -> jax.Array:
    """`eqx_offload.nnx_jit` as a decorator, with and without `nnx.jit`'s arguments (its
    NNX programs: tests/jit/test_programs.py)."""

    @eqx_offload.nnx_jit
    def double(x: jax.Array) -> jax.Array:
        return 2 * x

    @eqx_offload.nnx_jit(static_argnums=1)
    def scale(x: jax.Array, factor: float) -> jax.Array:
        return factor * x

    result: jax.Array = scale(double(x), 3.0)
    return result


def make_layer(key: jax.Array) -> eqx.nn.Linear:
    return eqx.nn.Linear(4, 4, key=key)


def make_layers(key: jax.Array) -> eqx.nn.Linear:
    """Stacked layers that `filter_make` makes one layer at a time."""
    layers: eqx.nn.Linear = eqx_offload.stack_layers(make_layer, jax.random.split(key, 3))
    return layers


def scanned_loss(layers: eqx.nn.Linear, x: jax.Array) -> jax.Array:
    return jnp.sum(eqx_offload.scan_layers(layers, x))


def identity(model: eqx.nn.Linear) -> eqx.nn.Linear:
    return model


def start_up_and_update_in_backward(key: jax.Array) -> jax.Array:
    """The start-up route and the update inside the backward pass, as users type them."""
    layers = eqx_offload.filter_make(make_layers, key)
    fused: eqx_offload.types.BackwardUpdate[eqx.nn.Linear] = eqx_offload.update_in_backward(
        optax.adam(1e-3), layers=identity, offload=eqx_offload.offloaded)
    untyped = eqx_offload.update_in_backward(  # (the model's type from the annotation, or Any)
        eqx_offload.master_weights(optax.adam(1e-3)), layers=lambda m: m.blocks)
    assert untyped.offload is None
    layers, state = fused.init(layers)
    assert isinstance(state, eqx_offload.types.BackwardState)
    value, layers, state = fused.step(scanned_loss, layers, state, jnp.ones(4))
    result: jax.Array = value
    return result


def plan_the_start_up(key: jax.Array) -> bool:
    """The start-up's plan for a TPU v5e, with the runtime's share of the host."""
    target: eqx_offload.planner.TpuTarget = eqx_offload.planner.TPU_TARGETS["v5e"]
    planned: eqx_offload.planner.StartupPlan = eqx_offload.planner.plan_startup(
        make_layers, key, target=target,
        runtime_host_memory=eqx_offload.planner.RUNTIME_HOST_BYTES.get("v5e"))
    return planned.fits

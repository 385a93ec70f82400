"""Ported programs (tests/ports/): Equinox's MNIST and vision-transformer examples, Flax
NNX, optimistix's `OptaxMinimiser`, as written and ported, bitwise (the DCGAN ports:
test_donation.py); and what `filter_jit` does for such programs."""

from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_same_run, assert_tree_equal, unwrap
from isolated import call_isolated
from ports import dcgan_example, meta_learning, mnist, nnx as nnx_port, nnx_mnist, schedule_free
from ports import solver, stacked_lm, vit
from ports.common import batches, expected_placement

import eqx_offload


# name -> (the program, plain or ported; a check of the ported run's extras)
PROGRAMS: dict[str, Any] = {
    # The example's `eqx.filter_jit` evaluations compile once each (with the docs' remedy).
    "mnist": (lambda port: mnist.train(port, "none"), lambda run: run.extra[1] == 2),
    "mnist-donated": (lambda port: mnist.train(port, "all"), lambda run: run.extra[1] == 2),
    "vit": (lambda port: vit.train(port, "none"), None),
    "vit-donated": (lambda port: vit.train(port, "all"), None),
    "nnx-jit": (lambda port: nnx_port.train(port, "nnx_jit"), None),
    # Every array passed to the donating step consumed; mu and nu of each param in host.
    "nnx-functional": (lambda port: nnx_port.train(port, "functional"), lambda run: (
        run.extra[1] == [True] * nnx_port.STEPS and list(run.placements[-1].values()).count(
            "pinned_host") == 2 * len(jax.tree.leaves(run.model)))),
    "optimistix": (lambda port: solver.train(port), lambda run: int(run.extra) == solver.MAX_STEPS),
    # Micro-batches summed in the step with the blocks' weights (and, bf16, their fp32
    # master weights) in host memory: bitwise the blocks on the device.
    "micro-batches-host-blocks": (lambda port: stacked_lm.train(port), lambda run: (
        run.model.blocks.mlp.layers[0].weight.sharding.memory_kind == "pinned_host")),
    "micro-batches-bf16-master": (lambda port: stacked_lm.train_bf16(port), lambda run: (
        run.model.blocks.attention.query_proj.weight.dtype == jnp.bfloat16
        and run.model.blocks.attention.query_proj.weight.sharding.memory_kind == "pinned_host")),
    # A function of its own reads the state (schedule-free evaluation); the model as
    # the jitted function.
    "schedule-free": (lambda port: schedule_free.train(port), None),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_ported_program(name: str) -> None:
    """The ported run is bitwise the plain one (`assert_same_run`)."""
    train, check = PROGRAMS[name]
    plain, ported = train(False), train(True)
    assert_same_run(plain, ported)
    assert check is None or check(ported), ported.extra


def test_mnist_without_the_remedy_compiles_the_users_functions_twice() -> None:
    # Why the remedy is there (upstream): the step's outputs are committed, the model
    # before the first step was not, and `jax.jit` keys its cache on committedness.
    ported = mnist.train(True, commit=False)
    assert ported.extra[1] == 4


def test_flax_nnx_jit_itself_compiles_twice() -> None:
    # Why the NNX port uses `eqx_offload.nnx_jit` (upstream behaviour, as in MNIST).
    ported = nnx_port.train(True, "nnx_jit", nnx_jit=False)
    assert ported.compiles[:3] == [1, 1, 0]


def test_flax_nnx_mnist_with_metrics_and_rngs_compiles_as_plain() -> None:
    """Flax's MNIST tutorial (metrics and `nnx.Rngs` passed to the step, `metrics.reset()`,
    an `eval_step`): bitwise the plain run, compiling when it does. `nnx.jit` itself,
    even with the model and optimizer committed first, compiles again at step 1 (the
    metrics and the key come back committed) and after each `reset()`."""
    plain, ported = nnx_mnist.train(False), nnx_mnist.train(True)
    assert_tree_equal((plain.losses, plain.model, plain.opt_state, plain.extra),
                      (ported.losses, ported.model, unwrap(ported.opt_state), ported.extra))
    assert "pinned_host" in ported.placements[-1].values()
    assert ported.placements == [expected_placement(ported.opt_state)] * nnx_mnist.STEPS
    assert ported.compiles == plain.compiles and sum(plain.compiles) >= 3, plain.compiles
    assert len(ported.extra[0]["test_accuracy"]) == 2
    committed_first = nnx_mnist.train(True, nnx_jit=False)
    assert sum(committed_first.compiles) > sum(plain.compiles), committed_first.compiles


@pytest.mark.parametrize("jit", list(meta_learning.JITS))
def test_optax_meta_learning_through_offloaded_updates(jit: str) -> None:
    """Optax's meta-learning example: `jax.grad` through the inner updates and the
    hyperparameter written into the state, every leaf in host memory; bitwise the plain
    run (thetas, learning rates, states), compiling as it does with the documented jits.
    Under `jax.jit` itself the step compiles again at step 1: the state is committed
    (host memory), so everything the step returns is (as for MNIST without the remedy)."""
    plain, ported = meta_learning.train(False, jit), meta_learning.train(True, jit)
    assert_tree_equal((plain.losses, plain.opt_state, plain.extra),
                      (ported.losses, unwrap(ported.opt_state), ported.extra))
    learning_rates = plain.extra[0]
    assert len({float(x) for x in learning_rates}) == meta_learning.STEPS  # it learns
    assert all(set(p.values()) == {"pinned_host"} for p in ported.placements)
    expected = plain.compiles if jit != "jax.jit" else [1, 1] + [0] * (meta_learning.STEPS - 2)
    assert ported.compiles == expected, (plain.compiles, ported.compiles)


def nnx_jit_donated_child() -> dict[str, Any]:
    """`nnx.jit(train_step, donate_argnums=(1,))` with an offloaded optimizer: the error,
    whether it deleted any array, then the losses of the step under `nnx.jit` undonated."""
    from flax import nnx

    model = nnx_port.MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, eqx_offload.offloaded(optax.adamw(1e-2)), wrt=nnx.Param)

    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(nnx_port.loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    (x, y), *_ = batches(jax.random.key(1), nnx_port.STEPS, (nnx_port.BATCH, nnx_port.IN))
    arrays = jax.tree.leaves(nnx.state((model, optimizer)))
    try:
        nnx.jit(train_step, donate_argnums=(1,))(model, optimizer, x, y)
        error = ""
    except eqx_offload.errors.CompositionError as e:
        error = str(e)
    deleted = any(a.is_deleted() for a in arrays)
    losses = [float(nnx.jit(train_step)(model, optimizer, x, y)) for _ in range(3)]
    return {"error": error, "deleted": deleted, "losses": losses}


def test_flax_nnx_jit_donation_fails_clearly() -> None:
    # JAX would pair a donated host state leaf with a device output and abort (docs/nnx.md);
    # `offloaded` raises while traced: nothing deleted, the program goes on undonated.
    result = call_isolated(nnx_jit_donated_child)
    assert "traced for a jit that donates (nnx_jit_donated_child.<locals>.train_step)" in (
        result["error"]), result
    assert "eqx_offload.filter_jit" in result["error"] and "functional API" in result["error"]
    assert not result["deleted"]
    losses = result["losses"]
    assert losses[2] < losses[0]


def test_optimistix_solver_moves_the_state_every_iteration() -> None:
    # docs/solvers.md: the copies to the device and back are in the solve loop's body.
    import optimistix as optx

    def lowered(optim: Any) -> str:
        minimiser = optx.OptaxMinimiser(optim, rtol=1e-8, atol=1e-8)

        @eqx_offload.filter_jit
        def solve(y0, args):
            return optx.minimise(solver.rosenbrock, minimiser, y0, args, max_steps=5,
                                 throw=False).value

        y0 = {"x": jnp.zeros(6), "w": jnp.ones((3, 4))}
        return solve.export(platforms=["cuda"])(y0, jnp.ones(4)).mlir_module()

    plain = lowered(optax.adam(1e-2))
    ported = lowered(eqx_offload.offloaded(optax.adam(1e-2)))
    assert "annotate_device_placement" not in plain
    body = ported[ported.index("stablehlo.while"):]
    # mu and nu of both leaves, to the device and back: 4 leaves x 2 directions.
    assert body.count("annotate_device_placement") >= 8


def test_dcgan_example_donate_all_names_the_read_only_model() -> None:
    # `donate="all"` consumes the generator that `step_discriminator` only reads.
    with pytest.raises(eqx_offload.errors.DonationError,
                       match=r"donate only what it returns(.|\n)*filter_jit\(_step_generator\): "
                             r"args\[0\] \(`generator`\), leaf \.layers\[1\]\.weight "):
        dcgan_example.train(True, donate="all")

"""Ported programs (tests/ports/): Equinox's MNIST and vision-transformer examples, Flax
NNX, optimistix's `OptaxMinimiser`, as written and ported, bitwise (the DCGAN ports:
test_donation.py); and what `filter_jit` does for such programs."""

from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_same_run
from isolated import call_isolated
from ports import dcgan_example, mnist, nnx as nnx_port, solver, vit
from ports.common import batches

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


def test_flax_nnx_jit_without_commit_compiles_twice() -> None:
    # Why the NNX port commits the model first (upstream behaviour, as in MNIST).
    ported = nnx_port.train(True, "nnx_jit", commit_first=False)
    assert ported.compiles[:3] == [1, 1, 0]


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
    except eqx_offload.CompositionError as e:
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
    with pytest.raises(eqx_offload.DonationError,
                       match=r"donate only what it returns(.|\n)*filter_jit\(_step_generator\): "
                             r"args\[0\] \(`generator`\), leaf \.layers\[1\]\.weight "):
        dcgan_example.train(True, donate="all")

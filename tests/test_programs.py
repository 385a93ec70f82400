"""Ported programs (tests/ports/): Equinox's MNIST and vision-transformer examples, Flax
NNX's `nnx.Optimizer`, optimistix's `OptaxMinimiser`, each as written and ported, bitwise
(the DCGAN ports, whose models share buffers: test_donation.py); and what `filter_jit`
does for such programs: compile counts, a donating `nnx.jit` refused, the DCGAN example's
read-only model named."""

from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import memory_kinds
from isolated import call_isolated
from ports import dcgan_example, mnist, nnx as nnx_port, solver, vit
from test_ports import _assert_same_run

import eqx_offload


# name -> (the program, plain or ported; a check of the ported run's extras)
PROGRAMS: dict[str, Any] = {
    # The example's `eqx.filter_jit` evaluations compile once each (with the docs'
    # remedy, `commit=True`).
    "mnist": (lambda port: mnist.train(port, "none"), lambda run: run.extra[1] == 2),
    "mnist-donated": (lambda port: mnist.train(port, "all"), lambda run: run.extra[1] == 2),
    "vit": (lambda port: vit.train(port, "none"), None),
    "vit-donated": (lambda port: vit.train(port, "all"), None),
    "nnx-jit": (lambda port: nnx_port.train(port, "nnx_jit"), None),
    "nnx-functional": (lambda port: nnx_port.train(port, "functional"), None),
    "optimistix": (lambda port: solver.train(port), lambda run: int(run.extra) == solver.MAX_STEPS),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_ported_program(name: str) -> None:
    """The ported run is bitwise the plain one (`_assert_same_run`)."""
    train, check = PROGRAMS[name]
    plain, ported = train(False), train(True)
    _assert_same_run(plain, ported)
    assert check is None or check(ported), ported.extra


def test_mnist_without_the_remedy_compiles_the_users_functions_twice() -> None:
    # Why the remedy is there (upstream behaviour): the step's outputs are committed
    # (its offloaded state is: JAX commits host arrays), the model before the first
    # step was not, and `jax.jit` keys its cache on committedness.
    ported = mnist.train(True, commit=False)
    assert ported.extra[1] == 4


def test_flax_nnx_functional_donates() -> None:
    from flax import nnx

    model = nnx_port.MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, eqx_offload.offloaded(optax.adamw(1e-2)), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    @eqx_offload.filter_jit(donate="all")
    def train_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(nnx_port.loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    for x, y in nnx_port.data(jax.random.key(1))[:2]:
        old = jax.tree.leaves(state)
        state, _ = train_step(state, x, y)
        assert all(a.is_deleted() for a in old)
    nnx.update((model, optimizer), state)
    kinds = memory_kinds(optimizer.opt_state)
    assert kinds and all(kind == ("device" if "count" in path else "pinned_host")
                         for path, kind in kinds.items()), kinds
    offloaded = [a for a in jax.tree.leaves(state) if a.sharding.memory_kind == "pinned_host"]
    assert len(offloaded) == 2 * len(jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_flax_nnx_jit_without_commit_compiles_twice() -> None:
    # Why the NNX port commits the model first (upstream behaviour, as in MNIST).
    ported = nnx_port.train(True, "nnx_jit", commit_first=False)
    assert ported.compiles[:3] == [1, 1, 0]


def nnx_jit_donated_child() -> dict[str, Any]:
    """`nnx.jit(train_step, donate_argnums=(1,))` with an offloaded optimizer: the first
    call's error, whether it deleted any array of the model or the optimizer, and then
    the same step under `nnx.jit` without donation (it trains, from where it was)."""
    from flax import nnx

    model = nnx_port.MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, eqx_offload.offloaded(optax.adamw(1e-2)), wrt=nnx.Param)

    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(nnx_port.loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    (x, y), *_ = nnx_port.data(jax.random.key(1))
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
    # `nnx.jit` hands `jax.jit` no memory-kind-aware output shardings, so JAX would pair
    # a donated host-memory state leaf with a device output of the same shape and the
    # process would abort (docs/nnx.md; plain JAX's pairing is pinned by the canary
    # tests/upstream/test_upstream_donation.py). `offloaded` sees the donating jit
    # while it is traced and raises: nothing has run, nothing is deleted, and the
    # program goes on without donation. (In a child: were the check to miss, the
    # abort would not take the test run with it.)
    result = call_isolated(nnx_jit_donated_child)
    assert "traced for a jit that donates (nnx_jit_donated_child.<locals>.train_step)" in (
        result["error"]), result
    assert "eqx_offload.filter_jit" in result["error"] and "functional API" in result["error"]
    assert not result["deleted"]
    losses = result["losses"]
    assert losses[2] < losses[0]


def test_optimistix_solver_moves_the_state_every_iteration() -> None:
    # What docs/solvers.md says: inside the solve loop the state goes to the device and
    # back at every iteration (the copies are in the loop body of the CUDA program).
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
    # `donate="all"` consumes the generator that `step_discriminator` only reads; the
    # next step gets a `DonationError` that names it and says the fix (plain
    # `eqx.filter_jit` fails earlier: the states share the models' arrays).
    with pytest.raises(eqx_offload.DonationError,
                       match=r"filter_jit\(_step_generator\): args\[0\] \(`generator`\), "
                             r"leaf \.layers\[1\]\.weight .* donate only what it returns"):
        dcgan_example.train(True, donate="all")

"""optimistix: `optx.minimise` with `optx.OptaxMinimiser(optax.adam(...))`, as optimistix
documents it. `optx.minimise` jits itself: `eqx_offload.filter_jit` goes around the user's
function that calls it (docs/solvers.md)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import optimistix as optx

import eqx_offload  # (1) the import

from .common import Recorder, Run


SOLVES = 4
MAX_STEPS = 30


def rosenbrock(y: dict[str, jax.Array], args: jax.Array) -> jax.Array:
    x = y["x"]
    rosen = jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)
    return rosen + jnp.sum((y["w"] @ args) ** 2)


def train(port: bool, donate: str = "none") -> Run:
    del donate  # (optimistix owns the loop's buffers)
    optim = optax.adam(1e-2)
    if port:
        optim = eqx_offload.offloaded(optim)  # (2)
    solver = optx.OptaxMinimiser(optim, rtol=1e-8, atol=1e-8)
    jit = eqx_offload.filter_jit if port else eqx.filter_jit  # (3)

    @jit
    def solve(y0, args):
        solution = optx.minimise(rosenbrock, solver, y0, args, max_steps=MAX_STEPS, throw=False)
        return solution.value, solution.state.opt_state, solution.stats["num_steps"]

    recorder = Recorder(port)
    y = {"x": jnp.zeros(6), "w": jnp.ones((3, 4))}
    for k in jr.split(jr.key(0), SOLVES):
        args = jr.normal(k, (4,))
        with recorder.step():
            y, opt_state, steps = solve(y, args)
        recorder.record(rosenbrock(y, args), opt_state)
    return recorder.run(y, opt_state, extra=steps)

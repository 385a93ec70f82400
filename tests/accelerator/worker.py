"""One training run in a process of its own, for the accelerator tier: the device's peak
memory and the process's resident memory cannot be reset within a process.

    python worker.py MODE WIDTH DEPTH STEPS   (MODE: plain, default, whole)

Prints one JSON object: the losses, the device peak, the resident bytes before the model
is made, after `init`, after each step and at the peak, and the state's bytes."""

import json
import resource
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_offload


def resident() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_resident() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(mode: str, width: int, depth: int, steps: int) -> None:
    before = resident()
    model = eqx.nn.MLP(width, width, width, depth, key=jax.random.key(0))
    x, y = jax.random.normal(jax.random.key(1), (2, 512, width))
    optimizer = {"plain": optax.adamw(1e-3),
                 "default": eqx_offload.offloaded(optax.adamw(1e-3)),
                 "whole": eqx_offload.offloaded(optax.adamw(1e-3), group_bytes=None)}[mode]
    jit = eqx.filter_jit if mode == "plain" else eqx_offload.filter_jit
    jax.block_until_ready((model, x, y))
    made = resident()
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    jax.block_until_ready(state)
    after_init = resident()

    @jit(donate="all")
    def step(model, state, x, y):
        loss, grads = eqx.filter_value_and_grad(
            lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    losses, after_steps = [], []
    for _ in range(steps):
        model, state, loss = step(model, state, x, y)
        losses.append(float(loss))
        after_steps.append(resident())
    stats = jax.devices()[0].memory_stats() or {}
    state_bytes = sum(a.nbytes for a in jax.tree.leaves(state) if a.ndim)
    print(json.dumps({
        "backend": jax.default_backend(), "losses": losses,
        "device_peak": stats.get("peak_bytes_in_use"), "state_bytes": state_bytes,
        "resident_before": before, "resident_model": made, "resident_init": after_init,
        "resident_steps": after_steps, "resident_peak": peak_resident(),
        "kinds": sorted({a.sharding.memory_kind for a in jax.tree.leaves(state)}),
    }))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))

"""The process that `tests/test_checkpoint.py` kills in the middle of a save.

    python tests/ckpt_worker.py DIRECTORY MODE

It trains a small model with an offloaded optimizer for one step and saves step 1
completely, writes the saved values to `DIRECTORY/expected.npz`, trains one more step
and starts saving step 2. In the middle of that save it prints `SAVING` and stops,
waiting to be killed:

- `orbax-writing`: orbax's `CheckpointManager`, after the first array of step 2 is
    written and before the others are;
- `orbax-committing`: orbax's `CheckpointManager`, after every array of step 2 is
    written, just before the checkpoint is committed (renamed into place);
- `eqx`: `eqx.tree_serialise_leaves` into a temporary file that is renamed into place
    once complete (the pattern in docs/checkpointing.md), after the first leaf.
"""

import os
import sys
import threading
import time
from typing import Any

import numpy as np


def stop_here() -> None:
    print("SAVING", flush=True)
    time.sleep(600)  # the parent kills us long before this ends


def train_state() -> tuple[Any, Any, Any]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_offload

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((64, 64), np.float32)),
              "b": jnp.asarray(rng.standard_normal((64,), np.float32))}
    opt = eqx_offload.offloaded(optax.adamw(1e-2))

    @eqx_offload.filter_jit(donate="all")
    def step(p: Any, s: Any) -> Any:
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(p["w"] @ p["b"]) ** 2))(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    return params, opt.init(params), step, eqx


def flat(tree: Any) -> dict[str, np.ndarray]:
    import jax

    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    params, state, step, eqx = train_state()
    params, state = step(params, state)
    if mode.startswith("orbax"):
        import orbax.checkpoint as ocp
        from orbax.checkpoint._src.path import atomicity
        from orbax.checkpoint._src.serialization import serialization

        manager = ocp.CheckpointManager(os.path.join(directory, "ckpt"))

        def save(i: int) -> None:
            manager.save(i, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), state=ocp.args.StandardSave(state)))

        save(1)
        manager.wait_until_finished()
        np.savez(os.path.join(directory, "expected.npz"), **flat((params, state)))
        params, state = step(params, state)

        if mode == "orbax-writing":
            original = serialization.async_serialize_from_host
            written = []

            async def write_one_then_stop(*args: Any, **kwargs: Any) -> Any:
                if written:
                    threading.Thread(target=stop_here).start()
                    await __import__("asyncio").sleep(600)
                written.append(True)
                return await original(*args, **kwargs)

            serialization.async_serialize_from_host = write_one_then_stop
        else:
            async def stop_before_commit(self: Any) -> None:
                stop_here()

            atomicity.AtomicRenameTemporaryPath.finalize = stop_before_commit  # type: ignore[method-assign]  # the point of the test
        save(2)
        manager.wait_until_finished()
    else:
        def save_atomically(path: str, tree: Any, filter_spec: Any = eqx.default_serialise_filter_spec) -> None:
            eqx.tree_serialise_leaves(path + ".tmp", tree, filter_spec=filter_spec)
            os.replace(path + ".tmp", path)

        save_atomically(os.path.join(directory, "step_1.eqx"), (params, state))
        np.savez(os.path.join(directory, "expected.npz"), **flat((params, state)))
        params, state = step(params, state)
        leaves_written = []

        def write_one_then_stop(f: Any, x: Any) -> None:
            if leaves_written:
                f.flush()
                stop_here()
            leaves_written.append(True)
            eqx.default_serialise_filter_spec(f, x)

        save_atomically(os.path.join(directory, "step_2.eqx"), (params, state), write_one_then_stop)
    print("FINISHED (the parent should have killed this process)", flush=True)


if __name__ == "__main__":
    main()

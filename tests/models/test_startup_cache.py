"""A second start-up of the same model reuses compiled programs: with JAX's persistent
compilation cache set by the user (docs/models.md, "Start-up"), a second process that
makes the same model and state with `filter_make` and runs the same step compiles
nothing: every program is a cache hit, and the cache folder gains no entry. So does one
after a process that only compiled (`filter_make(..., compile_only=True)`, the step
lowered from its abstract result)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


pytestmark = pytest.mark.both

CHILD = textwrap.dedent("""
    import json
    import os
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    import eqx_offload

    events = {}
    jax.monitoring.register_event_listener(
        lambda event, **_: events.__setitem__(event, events.get(event, 0) + 1))

    class Deep(eqx.Module):
        blocks: eqx.nn.Linear
        head: eqx.nn.Linear

        def __init__(self, key):
            kb, kh = jax.random.split(key)
            self.blocks = eqx_offload.stack_layers(
                lambda k: eqx.nn.Linear(32, 32, key=k), jax.random.split(kb, 4))
            self.head = eqx.nn.Linear(32, 1, key=kh)

        def __call__(self, x):
            return self.head(eqx_offload.scan_layers(self.blocks, x))

    mw = eqx_offload.master_weights(optax.adamw(1e-3))

    def start(key):
        deep = eqx.tree_at(lambda m: m.blocks, Deep(key), replace_fn=eqx_offload.to_host)
        return mw.init(deep)

    @eqx_offload.filter_jit(donate="all")
    def step(model, state, x):
        loss = lambda m: jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2)
        return mw.update(eqx.filter_grad(loss)(model), state, model)

    x = jnp.ones((4, 32), jnp.bfloat16)
    if os.environ.get("COMPILE_ONLY"):
        abstract = eqx_offload.filter_make(start, jax.random.key(0), compile_only=True)
        assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(abstract))
        step.lower(*abstract, x).compile()
    else:
        model, state = eqx_offload.filter_make(start, jax.random.key(0))
        model, state = step(model, state, x)
        jax.block_until_ready((model, state))
    prefix = "/jax/compilation_cache/"
    print(json.dumps({k[len(prefix):]: v for k, v in events.items() if k.startswith(prefix)}))
""")


def _start(cache: Path, **more: str) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(more)
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    counts: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return counts


def test_a_second_startup_compiles_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "jax-cache"
    first = _start(cache)
    entries = sorted(p.name for p in cache.iterdir())
    assert first.get("cache_misses", 0) > 5 and len(entries) >= first["cache_misses"]
    second = _start(cache)
    assert second.get("cache_misses", 0) == 0
    assert second["cache_hits"] == second["compile_requests_use_cache"] >= first["cache_misses"]
    assert sorted(p.name for p in cache.iterdir()) == entries


def test_a_startup_after_a_process_that_only_compiled_compiles_nothing(
        tmp_path: Path) -> None:
    cache = tmp_path / "jax-cache"
    first = _start(cache, COMPILE_ONLY="1")
    entries = sorted(p.name for p in cache.iterdir())
    assert first.get("cache_misses", 0) > 5 and len(entries) >= first["cache_misses"]
    second = _start(cache)
    assert second.get("cache_misses", 0) == 0, second
    assert second["cache_hits"] == second["compile_requests_use_cache"] >= first["cache_misses"]
    assert sorted(p.name for p in cache.iterdir()) == entries

"""Canary: what `plan` relies on, or works around, when libtpu compiles for a TPU without
one (`eqx_offload/_plan/tpu.py`, `_plan/hlo.py`). If an upgrade changes one, revisit
the code that names this file."""

import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from helpers import tpu_plan_marks
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, make_single_device_sharding

from eqx_offload._plan import tpu as _tpu
from eqx_offload._plan.hlo import scheduled_copies
from eqx_offload.planner import TPU_TARGETS


pytestmark = tpu_plan_marks()


def _chip(target: str = "v5e") -> jax.Device:
    return _tpu.devices(TPU_TARGETS[target].topologies, 1)[0]


def test_a_single_device_sharding_loses_its_memory_kind_in_the_trace() -> None:
    """An abstract argument whose `SingleDeviceSharding` is in `pinned_host` traces as
    device memory (no `<host>` in its type); over a one-device mesh it keeps host
    memory. So `_tpu.on_chips` gives every argument a `NamedSharding`."""
    chip = _chip()
    single = make_single_device_sharding(chip, memory_kind="pinned_host")
    meshed = NamedSharding(Mesh([chip], ("x",)), P(), memory_kind="pinned_host")
    avals = [jax.jit(lambda x: x).trace(jax.ShapeDtypeStruct((4,), jnp.float32, sharding=s))
             .jaxpr.in_avals[0] for s in (single, meshed)]
    assert [a.memory_space == jax.memory.Space.Host for a in avals] == [False, True]


def test_the_persistent_cache_cannot_load_a_compile_only_executable(
        tmp_path: pathlib.Path) -> None:
    """With JAX's persistent compilation cache on, the second compile of a module for a
    compile-only chip reads the first's entry and cannot load it (there is no client to
    load it on): JAX warns (an error where warnings are errors) and compiles again.
    `_tpu.compile_for` compiles through the topology's client, which never consults the
    cache (`test_the_plan_compiles_what_jit_compiles_and_leaves_the_config_alone`)."""
    chip = _chip()
    sharding = NamedSharding(Mesh([chip], ("x",)), P())
    x = jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=sharding)
    saved = {name: getattr(jax.config, name) for name in (
        "jax_enable_compilation_cache", "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes")}
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))  # (a cache of its own)
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        compilation_cache.reset_cache()
        jax.jit(lambda x: jnp.sin(x) @ x).lower(x).compile()  # written
        with pytest.warns(UserWarning, match="DeserializeLoadedExecutable"):
            jax.jit(lambda x: jnp.sin(x) @ x).lower(x).compile()  # read back
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@pytest.mark.parametrize("target", sorted(TPU_TARGETS))
def test_xla_tpu_refuses_a_step_above_the_hbm_it_makes_available(target: str) -> None:
    """XLA:TPU refuses a program whose temporaries exceed its HBM, and names what it
    makes available: `TpuTarget.device_memory_size`."""
    chip = _chip(target)
    sharding = NamedSharding(Mesh([chip], ("x",)), P())
    rows = 2 * TPU_TARGETS[target].device_memory_size // (4 * 1024)
    x = jax.ShapeDtypeStruct((rows, 1024), jnp.float32, sharding=sharding)
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as error:
        jax.jit(lambda x: jnp.sin(x) * jnp.cos(x).sum()).lower(x).compile()
    (available,) = re.findall(r"exceeds available HBM \(([0-9.]+)G\)", str(error.value))
    # (XLA rounds to 0.01 GiB; libtpu versions differ by as much on a v5p and a v6e.)
    assert abs(float(available) - TPU_TARGETS[target].device_memory_size / 2**30) <= 0.015


def test_xla_tpu_copies_into_its_own_alternate_memory() -> None:
    """XLA:TPU writes `copy-start`s between device memories (prefetches into `S(1)`) in
    a program without host memory: the plan counts only copies to or from `S(5)`."""
    chip = _chip()
    sharding = NamedSharding(Mesh([chip], ("x",)), P())
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32, sharding=sharding)
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=sharding)
    text = jax.jit(lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w)).lower(x, w).compile().as_text()
    assert any("S(1)" in line for line in text.splitlines() if "copy-start(" in line)
    assert scheduled_copies(text) == ()


def _no_metadata(text: str) -> str:
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def test_the_plan_compiles_what_jit_compiles_and_leaves_the_config_alone(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`_tpu.compile_for` (the topology's client, `compat.compile_for_devices`) makes the
    executable `Lowered.compile` makes: the same memory analysis and scheduled HLO
    (`jax.jit` adds only its sharding-propagation flags to the module's header). With
    the persistent cache on, a step plans twice, and JAX's configuration is never
    updated."""
    import eqx_offload

    chip = _chip()
    sharding = NamedSharding(Mesh([chip], ("x",)), P(), memory_kind="pinned_host")
    x = jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=sharding)
    step = eqx_offload.filter_jit(lambda x: jax.device_put(
        jnp.sin(jax.device_put(x, jax.memory.Space.Device)), jax.memory.Space.Host),
        donate="all")
    lowered, _, executable = _tpu.compile_for(step, (x,), {}, [chip], {})
    with_jit = lowered.compile()
    fields = ("argument_size_in_bytes", "temp_size_in_bytes", "output_size_in_bytes",
              "alias_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes")
    ours, jits = executable.get_compiled_memory_stats(), with_jit.memory_analysis()
    assert [getattr(ours, f) for f in fields] == [getattr(jits, f) for f in fields]
    body = [_no_metadata(t).split("\n", 1)[1] for t in (
        executable.hlo_modules()[0].to_string(), with_jit.as_text())]
    assert body[0] == body[1] and scheduled_copies(body[0])

    saved = {name: getattr(jax.config, name) for name in (
        "jax_enable_compilation_cache", "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs")}
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))  # (a cache of its own)
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        compilation_cache.reset_cache()
        updates: list[Any] = []
        monkeypatch.setattr(jax.config, "update", lambda *a: updates.append(a))
        on_cpu = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
            Mesh(jax.devices()[:1], ("x",)), P(), memory_kind="pinned_host"))
        first, second = (eqx_offload.plan(step, on_cpu, target="v5e") for _ in range(2))
        assert first == second and updates == []
    finally:
        monkeypatch.undo()
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


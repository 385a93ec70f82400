"""Canary: the private JAX and XLA calls `plan` makes for a GPU
(`compat.compile_for_devices`, used by `_plan/deviceless.py`) and the facts its reading
of the plan relies on: a compile-only CUDA topology without a GPU, whose devices have no
memories; lowered for `cuda`, a `device_put` to `pinned_host` inside `jit`
survives as a `copy-start`/`copy-done` pair (`S(5)`), and the memory stats count host
arguments apart. If an upgrade breaks one, fix `_core/compat/__init__.py`,
`_plan/deviceless.py` or `_plan/hlo.py`."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload
from eqx_offload._plan import deviceless as _deviceless
from helpers import gpu_plan_marks


pytestmark = gpu_plan_marks()


def _gpu():
    return _deviceless.topology(eqx_offload.planner.GPU_TARGETS["h100"].config_text(), 1).devices[0]


def test_compile_only_devices_have_no_memories():
    device = _gpu()
    assert device.platform == "gpu"
    assert "H100" in device.device_kind
    with pytest.raises(Exception):
        device.memory("pinned_host")


def _round_trip(n: int):
    """A jitted host -> device (x2) -> host step, and an (n, n) array in host memory."""
    on_host = jax.sharding.make_single_device_sharding(jax.devices("cpu")[0]).with_memory_kind(
        "pinned_host")

    def f(x):
        y = jax.device_put(x, jax.memory.Space.Device) * 2
        return jax.device_put(y, jax.memory.Space.Host)

    jitted = jax.jit(f, in_shardings=on_host, out_shardings=on_host)
    return jitted, jax.device_put(jnp.ones((n, n)), on_host)


def test_copies_survive_lowering_for_cuda_with_cpu_shardings():
    jitted, x = _round_trip(256)
    lowered = jitted.trace(x).lower(lowering_platforms=("cuda",))
    executable = _deviceless.compile_for(lowered, [_gpu()], {})
    stats = executable.get_compiled_memory_stats()
    assert stats.host_argument_size_in_bytes == 256 * 256 * 4
    assert stats.host_output_size_in_bytes == 256 * 256 * 4
    assert stats.argument_size_in_bytes == 0
    text = "\n".join(m.to_string() for m in executable.hlo_modules())
    copies = eqx_offload._plan.hlo.scheduled_copies(text)
    assert [c.direction for c in copies] == ["to_device", "to_host"]
    assert [c.nbytes for c in copies] == [256 * 256 * 4] * 2
    assert "S(5)" in text


def test_lowering_for_the_cpu_loses_the_copies():
    """Why the plan lowers for `cuda`: for the CPU (one memory), a `device_put` to the
    device inside `jit` lowers to nothing, so the GPU would compute on host memory."""
    jitted, x = _round_trip(64)
    placements = re.compile(r'_xla_buffer_placement = "(\w+)"')
    assert placements.findall(jitted.trace(x).lower().as_text()) == ["pinned_host"]
    assert placements.findall(jitted.trace(x).lower(lowering_platforms=("cuda",)).as_text()) == [
        "device", "pinned_host", "pinned_host"]


def _program(executable) -> str:
    """The optimized HLO without what no plan reads: source locations, the fingerprint
    before scheduling, and the autotuner's note on a fusion that keeps its default emitter
    (written at levels above 0 only). Any configuration the autotuner chose stays."""
    text = "\n".join(m.to_string() for m in executable.hlo_modules())
    text = re.sub(r"metadata=\{[^}]*\}", "", text)
    text = re.sub(r'fingerprint_before_lhs="[0-9a-f]*"', "", text)
    default_emitter = (', backend_config={"operation_queue_id":"0","force_earliest_schedule":'
                       'false,"reification_cost":[],"device_type":"DEVICE_TYPE_INVALID",'
                       '"native_emitter_backend_config":{"type":"NATIVE_EMITTER_TYPE_INVALID",'
                       '"unroll_factor":0}}')
    return text.replace(default_emitter, "")


def test_autotune_level_0_compiles_the_program_of_the_default_level():
    """Why `deviceless_options` compiles at `xla_gpu_autotune_level=0`: without a GPU the
    autotuner takes every default at any level, so a training step's program is that of
    the default level 4. If this fails after an upgrade, drop the level there."""
    model = eqx.nn.MLP(64, 64, 128, 2, key=jax.random.key(0))
    tx = eqx_offload.offloaded(optax.adamw(1e-3))
    state = tx.init(eqx.filter(model, eqx.is_array))
    x = jnp.ones((32, 64))

    @eqx_offload.filter_jit
    def step(model, state):
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    compiled = []
    compile_ = _deviceless._compile

    def keep(module, devices, options):
        compiled.append(compile_(module, devices, options))
        return compiled[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_deviceless, "_compile", keep)
        patch.delenv("XLA_FLAGS", raising=False)  # conftest.py's has no GPU level
        # From one line: the HLO's table of source locations holds the caller's.
        at_0, at_4 = (eqx_offload.planner.gpu_plan(step, model, state, target="h100",
                                           compiler_options=options)
                      for options in (None, {"xla_gpu_autotune_level": 4}))
    assert len(compiled) == 2
    level_0, level_4 = (_program(e) for e in compiled)
    assert "gemm_fusion" in level_4 and "copy-start" in level_4  # what it is meant to cover
    assert level_0 == level_4
    assert (at_0.device_peak_bytes, at_0.host_bytes, at_0.copies) == (
        at_4.device_peak_bytes, at_4.host_bytes, at_4.copies)


def test_deviceless_options_keep_a_level_given():
    assert _deviceless.deviceless_options({"a": 1}) == {"a": 1, "xla_gpu_autotune_level": 0}
    assert _deviceless.deviceless_options({"xla_gpu_autotune_level": 2}) == {
        "xla_gpu_autotune_level": 2}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=3")
        assert _deviceless.deviceless_options({}) == {}

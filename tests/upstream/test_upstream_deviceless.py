"""Canary (upstream behaviour, not the library's): the private JAX and XLA calls that
`eqx_offload.gpu_plan` makes (all in `eqx_offload/_deviceless.py`) and the facts its
reading of the plan relies on, on a step small enough to say exactly what must happen.

- A compile-only CUDA topology comes from `jax.experimental.topologies.get_topology_desc`
  with a `GpuTargetConfigProto` text, without a GPU; its devices have no memories.
- Lowered for `cuda` with CPU shardings, a `device_put` to `pinned_host` inside `jit`
  survives into the GPU program as a `copy-start`/`copy-done` pair whose destination
  layout carries `S(5)` (host memory), and `get_compiled_memory_stats()` counts host
  arguments apart from device ones.

If a JAX upgrade breaks one of these, fix `_deviceless.py` / `_hlo.py` and this file.
"""

import re

import jax
import jax.numpy as jnp
import pytest

import eqx_offload
from eqx_offload import _deviceless
from helpers import gpu_plan_marks


pytestmark = gpu_plan_marks()


def _gpu():
    target = eqx_offload.GPU_TARGETS["h100"]
    return _deviceless.topology(target.config_text(), 1).devices[0]


def test_compile_only_devices_have_no_memories():
    device = _gpu()
    assert device.platform == "gpu"
    assert "H100" in device.device_kind
    with pytest.raises(Exception):
        device.memory("pinned_host")


def test_copies_survive_lowering_for_cuda_with_cpu_shardings():
    cpu = jax.devices("cpu")[0]
    on_device = jax.sharding.SingleDeviceSharding(cpu)
    on_host = on_device.with_memory_kind("pinned_host")
    x = jax.device_put(jnp.ones((256, 256)), on_host)

    def f(x):
        y = jax.device_put(x, jax.memory.Space.Device) * 2
        return jax.device_put(y, jax.memory.Space.Host)

    jitted = jax.jit(f, in_shardings=on_host, out_shardings=on_host)
    lowered = jitted.trace(x).lower(lowering_platforms=("cuda",))
    executable = _deviceless.compile_for(lowered, [_gpu()], {})
    stats = executable.get_compiled_memory_stats()
    assert stats.host_argument_size_in_bytes == 256 * 256 * 4
    assert stats.host_output_size_in_bytes == 256 * 256 * 4
    assert stats.argument_size_in_bytes == 0
    text = "\n".join(m.to_string() for m in executable.hlo_modules())
    copies = eqx_offload._hlo.scheduled_copies(text)
    assert [c.direction for c in copies] == ["to_device", "to_host"]
    assert [c.nbytes for c in copies] == [256 * 256 * 4] * 2
    assert "S(5)" in text


def test_lowering_for_the_cpu_loses_the_copies():
    """Why the plan lowers for `cuda`: lowered for the CPU, a `device_put` to the device
    inside `jit` lowers to nothing (the CPU has one memory), so the module compiled for
    the GPU would compute on host memory."""
    cpu = jax.devices("cpu")[0]
    on_host = jax.sharding.SingleDeviceSharding(cpu).with_memory_kind("pinned_host")
    x = jax.device_put(jnp.ones((64, 64)), on_host)
    jitted = jax.jit(lambda x: jax.device_put(jax.device_put(x, jax.memory.Space.Device) * 2,
                                              jax.memory.Space.Host),
                     in_shardings=on_host, out_shardings=on_host)
    placements = re.compile(r'_xla_buffer_placement = "(\w+)"')
    assert placements.findall(jitted.trace(x).lower().as_text()) == ["pinned_host"]
    assert placements.findall(jitted.trace(x).lower(lowering_platforms=("cuda",)).as_text()) == [
        "device", "pinned_host", "pinned_host"]


def _program(executable) -> str:
    """The optimized HLO without what no plan reads: source locations, the fingerprint
    of the module before scheduling, and the autotuner's note on a fusion that keeps
    its default emitter (written at autotune levels above 0 only). Any other
    configuration the autotuner chose stays in the text."""
    text = "\n".join(m.to_string() for m in executable.hlo_modules())
    text = re.sub(r"metadata=\{[^}]*\}", "", text)
    text = re.sub(r'fingerprint_before_lhs="[0-9a-f]*"', "", text)
    default_emitter = (', backend_config={"operation_queue_id":"0","force_earliest_schedule":'
                       'false,"reification_cost":[],"device_type":"DEVICE_TYPE_INVALID",'
                       '"native_emitter_backend_config":{"type":"NATIVE_EMITTER_TYPE_INVALID",'
                       '"unroll_factor":0}}')
    return text.replace(default_emitter, "")


def test_autotune_level_0_compiles_the_program_of_the_default_level():
    """Why `_deviceless.deviceless_options` compiles at `xla_gpu_autotune_level=0`:
    without a GPU, XLA's autotuner takes every default configuration at any level, so
    the program (fusions, kernels' configurations, schedule, buffers) is the one of
    XLA's default level 4, compiled without the candidate kernels it cannot time. A
    training step with matrix products, loop fusions and host copies: if this fails
    after a JAX upgrade, drop the level from `deviceless_options`."""
    import equinox as eqx
    import optax

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
        at_0, at_4 = (eqx_offload.gpu_plan(step, model, state, target="h100",
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

"""Canary (upstream behaviour, not the library's): the private JAX and XLA calls that
`eqx_offload.gpu_plan` makes (all in `eqx_offload/_deviceless.py`) and the facts its
reading of the plan relies on, on a step small enough to say exactly what must happen.

- A compile-only CUDA topology comes from `jax.experimental.topologies.get_topology_desc`
  with a `GpuTargetConfigProto` text, without a GPU; its devices have no memories.
- Lowered for `cuda` with CPU shardings, a `device_put` to `pinned_host` inside `jit`
  survives into the GPU program as a `copy-start`/`copy-done` pair whose destination
  layout carries `S(5)` (host memory), and `get_compiled_memory_stats()` counts host
  arguments apart from device ones.

If a JAX upgrade breaks one of these, fix `_deviceless.py` / `_plan.py` and this file.
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
    copies = eqx_offload._plan.scheduled_copies(text)
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

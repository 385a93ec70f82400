"""Resident host memory for one host array made three ways, one process a row:

    python zeros_rss.py ROUTE DTYPE MIB

ROUTE: `stacked` (`filter_make` of 8 stacked layers in host memory: buffers of zeros
made by the host's CPU, then written a layer at a time), `whole` (`filter_make` of one
host leaf made whole), `numpy` (`jax.device_put` of NumPy's zeros into `pinned_host`),
`buffer` (the stacked route's first program alone: zeros made by the host's CPU),
`writes` (a buffer made whole, then the stacked route's 8 layer writes into it);
`direct` (the buffer as `jnp.zeros` of DTYPE by the host's CPU, no bitcast), `u32` (as
uint32 zeros of half the last axis, bitcast to DTYPE and reshaped there).
DTYPE: float32, bfloat16 or uint8. Prints one JSON line: resident memory above the start
(after the runtime's first array) against the bytes in host memory."""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import eqx_offload


def resident() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


def main(route: str, dtype_name: str, mib: int) -> dict:
    dtype = jnp.dtype(dtype_name)
    shape = (8, 1024, mib * 2**20 // 8 // 1024 // dtype.itemsize)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    stages = {}
    jnp.zeros(()).block_until_ready()
    start, began = resident(), time.perf_counter()
    if route == "stacked":
        def make(keys):
            return eqx_offload.to_host(eqx_offload.stack_layers(
                lambda k: jax.random.normal(k, shape[1:]).astype(dtype), keys))
        made = eqx_offload.filter_make(make, jax.random.split(jax.random.key(0), 8))
    elif route == "whole":
        made = eqx_offload.filter_make(lambda: eqx_offload.to_host(jnp.zeros(shape, dtype)))
    elif route == "buffer":  # (the library's own program, private)
        from eqx_offload._models.make import _host_program
        made = _host_program(jax.ShapeDtypeStruct(shape, dtype, sharding=host))()
    elif route in ("direct", "u32"):
        from eqx_offload._core.compat import host_compute

        def zeros():
            if route == "direct":
                return jnp.zeros(shape, dtype)
            bits = jnp.zeros((*shape[:-1], shape[-1] * dtype.itemsize // 4), jnp.uint32)
            return jax.lax.bitcast_convert_type(bits, dtype).reshape(shape)
        made = jax.jit(host_compute(zeros, compute_type="device_host",
                                    out_memory_spaces=jax.memory.Space.Host))()
    elif route == "writes":
        made = eqx_offload.filter_make(lambda: eqx_offload.to_host(jnp.zeros(shape, dtype)))
        made.block_until_ready()
        stages["buffer_rss_gb"] = (resident() - start) / 1e9

        def write(buffer, layer):
            row = jax.random.normal(jax.random.key(layer), (1, *shape[1:])).astype(dtype)
            return jax.lax.dynamic_update_slice_in_dim(buffer, eqx_offload.to_host(row), layer, 0)
        write = eqx_offload.filter_jit(write, donate=("buffer",))
        for i in range(8):
            made = write(made, jnp.int32(i))
    else:
        made = jax.device_put(np.zeros(shape, dtype), host)
    made.block_until_ready()
    return {"route": route, "dtype": dtype_name, "mib": mib, "s": time.perf_counter() - began,
            "memory_kind": made.sharding.memory_kind, "host_gb": made.nbytes / 1e9,
            "rss_gb": (resident() - start) / 1e9, **stages}


if __name__ == "__main__":
    row = main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "zeros_rss.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

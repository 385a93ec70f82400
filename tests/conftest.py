import os

# The CPU backend, also where the GPU compiler (jax-cuda12-plugin, for gpu_plan) is
# installed: without a GPU, JAX would try CUDA first and report a failed start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after JAX_PLATFORMS)


# 8 CPU devices for the multi-device tests; the default device stays CPU 0. Must run
# before any backend is initialised.
jax.config.update("jax_num_cpu_devices", 8)

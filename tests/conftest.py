import jax


# 8 CPU devices for the multi-device tests; the default device stays CPU 0. Must run
# before any backend is initialised.
jax.config.update("jax_num_cpu_devices", 8)

"""The test run's compilation cache (tests/conftest.py): one folder for the whole run,
shared by its processes, so that a program another process compiled is read back here."""

import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import pytest


pytestmark = pytest.mark.both  # (JAX's cache differs between versions)

SETTINGS = ("jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
CHILD = """
import jax, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", {folder!r})
for name, value in {settings!r}.items():
    jax.config.update(name, value)
jax.jit(lambda x: x * 3.0 + {constant!r})(jnp.arange(5.0)).block_until_ready()
"""


def test_a_program_another_process_compiled_is_read_back() -> None:
    folder = jax.config.jax_compilation_cache_dir
    assert folder == os.environ["EQX_OFFLOAD_TEST_JAX_CACHE"]  # the run's, not a worker's
    settings = {name: getattr(jax.config, name) for name in SETTINGS}
    constant = 1.0 + os.getpid() % 1000  # (a program no test compiled before)
    code = CHILD.format(folder=folder, settings=settings, constant=constant)
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, timeout=600,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    x = jnp.arange(5.0)
    hits: list[str] = []

    def listener(event: str, **kwargs: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.monitoring.register_event_listener(listener)
    try:
        jax.jit(lambda x: x * 3.0 + constant)(x).block_until_ready()
    finally:
        jax.monitoring.unregister_event_listener(listener)
    assert hits == ["/jax/compilation_cache/cache_hits"]

"""User mistakes with `where` filters."""

import jax.numpy as jnp

import eqx_offload

params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}

# A path string is not a filter: wrap it in `eqx_offload.pattern`.
eqx_offload.to_host(params, where=".*/w")  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# A number is not a filter: use `eqx_offload.min_bytes(...)` or `min_ndim(...)`.
eqx_offload.to_device(params, where=1024)  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# `min_bytes` takes a number of bytes.
eqx_offload.min_bytes("1MiB")  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# `pattern` takes a regular expression.
eqx_offload.pattern(0)  # expect: mypy=arg-type pytype=wrong-arg-types pyright=reportArgumentType pyrefly=bad-argument-type

# A prefix tree with a string at a leaf.
eqx_offload.to_host(params, where={"w": True, "b": "yes"})  # expect: mypy=dict-item pyright=reportArgumentType pyrefly=bad-assignment

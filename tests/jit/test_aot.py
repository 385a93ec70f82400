"""`filter_jit`'s ahead-of-time API (`.lower(...).compile()`, as `eqx.filter_jit`), its
per-executable compiler options, and one trace of the user's function per compilation."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import pytest
from donation_harness import mlp_setup, mlp_step
from helpers import assert_tree_equal, count_compiles, unchecked, v5e

import eqx_offload


pytestmark = pytest.mark.both  # JAX-version dependent


def _setup() -> tuple[Any, Any, Any, Any]:
    model, opt, state, x = mlp_setup()
    return model, state, mlp_step(opt), x


def test_lower_compile_call_equals_the_call() -> None:
    model, state, step, x = _setup()
    jitted = eqx_offload.filter_jit(step, donate="all")
    ref = eqx_offload.filter_jit(step)(model, state, x)
    lowered = jitted.lower(model, state, x)
    assert isinstance(lowered, eqx_offload.types.Lowered)
    assert "pinned_host" in lowered.as_text()
    compiled = lowered.compile()
    assert isinstance(compiled, eqx_offload.types.Compiled)
    assert compiled.memory_analysis().argument_size_in_bytes > 0
    # XLA's cost model read the program: its floating-point operations are counted.
    assert compiled.cost_analysis()["flops"] > 0
    assert "HloModule" in (compiled.as_text() or "")
    donated = jtu.tree_leaves(state)
    out = compiled(model, state, x)
    assert all(leaf.is_deleted() for leaf in donated)  # the compiled call donates too
    assert_tree_equal(eqx.filter(out, eqx.is_array), eqx.filter(ref, eqx.is_array))
    mu = out[1].inner_state[0].mu.layers[0].weight
    assert mu.sharding.memory_kind == "pinned_host"


def test_lower_from_shape_dtype_structs_takes_the_arrays() -> None:
    """`lower` from `jax.ShapeDtypeStruct`s (as `jax.jit(f).lower`): a spec stands for
    an array of its shape, dtype and sharding (a host one over a one-device mesh, as
    `filter_eval_shape` gives it, is traced in host memory), and the executable takes
    the arrays themselves with the call's result."""
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("_",))
    host = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host")
    w = jax.device_put(jnp.arange(16.0).reshape(4, 4), host)
    x = jax.device_put(jnp.ones(4), jax.devices()[0])

    def forward(w: jax.Array, x: jax.Array) -> jax.Array:
        return eqx_offload.to_device(w) @ x

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in (w, x)]
    lowered = eqx_offload.filter_jit(forward).lower(*specs)
    assert [a.memory_space for a in lowered.jaxpr.in_avals] == [
        jax.memory.Space.Host, jax.memory.Space.Device]
    assert_tree_equal(lowered.compile()(w, x), eqx_offload.filter_jit(forward)(w, x))


def test_user_function_traced_once_per_compilation() -> None:
    """The step runs once per compilation (so do `offloaded`'s update path and its `where`
    resolution); `.lower(...).compile()` does not fill the call's cache, and its executable
    rejects other arguments."""
    model, state, step, x = _setup()
    calls = []

    def counted(model: Any, state: Any, x: jax.Array) -> Any:
        calls.append(1)
        return step(model, state, x)

    jitted = eqx_offload.filter_jit(counted)
    compiled = jitted.lower(model, state, x).compile()
    with pytest.raises(eqx_offload.errors.SignatureError, match="differ from those it was lowered for"):
        compiled(model, state, jnp.ones((5, 3)))
    with pytest.raises(TypeError):  # a SignatureError is a TypeError too
        compiled(model, state, x.astype(jnp.float16))
    with count_compiles("counted") as compiles:
        for _ in range(3):
            model, state, _ = jitted(model, state, x)
    assert len(compiles) == 1
    assert len(calls) == 2
    jitted.lower(model, state, x)
    assert len(calls) == 3


def test_compiler_options_reach_the_executable() -> None:
    """Options are per executable: a valid one compiles, an unknown one is XLA's error
    (so they really are passed), both at `filter_jit(...)` and at `.compile(...)`."""
    model, state, step, x = _setup()
    good = {"xla_cpu_enable_fast_math": False}
    eqx_offload.filter_jit(step, compiler_options=good)(model, state, x)
    eqx_offload.filter_jit(step).lower(model, state, x).compile(good)
    bad = {"xla_no_such_option_for_eqx_offload": True}
    with pytest.raises(Exception, match="xla_no_such_option_for_eqx_offload"):
        eqx_offload.filter_jit(step, compiler_options=bad)(model, state, x)
    with pytest.raises(Exception, match="xla_no_such_option_for_eqx_offload"):
        eqx_offload.filter_jit(step).lower(model, state, x).compile(bad)


@pytest.mark.parametrize("kwargs, match", [
    ({"donate": "some"}, "donate must be one of"),
    ({"compiler_options": ["xla_flag"]}, "compiler_options must be a dict")])
def test_bad_options_are_option_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(eqx_offload.errors.OptionError, match=match):
        unchecked(eqx_offload.filter_jit)(lambda x: x, **kwargs)


def test_methods() -> None:
    class Scaler(eqx.Module):
        factor: float

        @eqx_offload.filter_jit
        def __call__(self, x: jax.Array) -> jax.Array:
            return x * self.factor

    assert_tree_equal(Scaler(2.0)(jnp.ones(3)), jnp.full(3, 2.0))


def test_lower_for_tpu_keeps_a_single_device_pinned_host_argument_in_host_memory() -> None:
    """`lower_for(("tpu",), ...)` on libtpu's compile-only chip: an argument of a
    `SingleDeviceSharding` in `pinned_host` is lowered in host memory (over a one-device
    mesh, as `plan` does), so a step with weights in host memory compiles with them
    there; without the mesh it was typed as device memory."""
    chip = v5e()
    host = jax.sharding.make_single_device_sharding(chip, memory_kind="pinned_host")
    device = jax.sharding.make_single_device_sharding(chip, memory_kind="device")
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=host)
    x = jax.ShapeDtypeStruct((256,), jnp.float32, sharding=device)

    def forward(w: jax.Array, x: jax.Array) -> jax.Array:
        return eqx_offload.to_device(w) @ x

    lowered = eqx_offload.filter_jit(forward).lower_for(("tpu",), (w, x), {})
    assert [a.memory_space for a in lowered.jaxpr.in_avals] == [
        jax.memory.Space.Host, jax.memory.Space.Device]
    compiled = lowered.compile()
    assert compiled.memory_analysis().host_argument_size_in_bytes == 256 * 256 * 4

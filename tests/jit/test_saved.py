"""A compiled step saved as bytes (`Compiled.serialize`) and loaded by a later process
(`filter_jit(step).load`): that process traces and compiles nothing for the step, runs it
on `filter_make`'s arrays with bitwise the results of the step compiled there, its state
still in host memory and its donated inputs consumed. An Equinox MLP's static fields
(`jax.nn.relu`, a module's lambda, Equinox's `MISSING`) go by name."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_offload
from eqx_offload.errors import OptionError
from isolated import result_of, run_isolated


pytestmark = pytest.mark.both

CHILD = textwrap.dedent("""
    import json
    import sys
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    import eqx_offload

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(lambda event, seconds, **_: (
        compiles.append(event) if event.endswith("backend_compile_duration") else None))
    traces = []
    opt = eqx_offload.offloaded(optax.adamw(1e-2))

    def start(key):
        model = eqx.nn.MLP(8, 8, 16, 2, key=key)
        return model, opt.init(eqx.filter(model, eqx.is_array))

    @eqx_offload.filter_jit(donate=("model", "state"))
    def step(model, state, x):
        traces.append(1)
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    key, x = jax.random.key(0), jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)
    path = sys.argv[2]
    if sys.argv[1] == "save":
        abstract = eqx_offload.checkpoint.filter_eval_shape(start, key)
        with open(path, "wb") as f:
            f.write(step.lower(*abstract, x).compile().serialize())
        print(json.dumps({}))
    else:
        model, state = eqx_offload.filter_make(start, key)
        before = len(compiles)
        with open(path, "rb") as f:
            loaded = step.load(f.read())
        out = loaded(model, state, x)
        consumed = all(a.is_deleted() for a in jax.tree.leaves((model, state))
                       if eqx.is_array(a))
        out = loaded(*out, x)
        loaded_compiles = len(compiles) - before
        kinds = lambda s: [a.sharding.memory_kind for a in jax.tree.leaves(s) if eqx.is_array(a)]
        model, state = eqx_offload.filter_make(start, key)
        ref = step(*step(model, state, x), x)
        same = all(bool(jnp.array_equal(a, b)) if eqx.is_array(a) else a is b for a, b in
                   zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True))
        print(json.dumps({"traces": len(traces), "compiles": loaded_compiles,
                          "consumed": consumed, "same": same, "same_kinds": kinds(out) ==
                          kinds(ref), "kinds": sorted(set(kinds(out[1].inner_state)))}))
""")


def _child(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_a_step_loaded_in_another_process_traces_and_compiles_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "step.bin")
    _child("save", path)
    loaded = _child("load", path)
    # One trace, by the reference step compiled after the loaded one ran; the state's
    # moments in host memory (its step count, a scalar, on the device).
    assert loaded == {"traces": 1, "compiles": 0, "consumed": True, "same": True,
                      "same_kinds": True, "kinds": ["device", "pinned_host"]}


def _step(model: dict, x: jax.Array) -> dict:
    return jax.tree.map(lambda w: w * x, model)


def test_bytes_load_only_into_the_function_and_donation_they_were_saved_from() -> None:
    model = {"w": jnp.ones(3)}
    step = eqx_offload.filter_jit(_step)
    data = step.lower(model, jnp.float32(2)).compile().serialize()
    assert step.load(data)(model, jnp.float32(2))["w"].tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(OptionError, match=r"saved from `_step`"):
        eqx_offload.filter_jit(lambda m, x: _step(m, x)).load(data)
    with pytest.raises(OptionError, match="another donate"):
        eqx_offload.filter_jit(_step, donate="all").load(data)
    with pytest.raises(eqx_offload.errors.SignatureError):
        step.load(data)({"w": jnp.ones(4)}, jnp.float32(2))


def test_a_static_argument_that_does_not_pickle_is_refused() -> None:
    step = eqx_offload.filter_jit(lambda m, f: jax.tree.map(f, m))
    compiled = step.lower({"w": jnp.ones(3)}, lambda w: w + 1).compile()
    with pytest.raises(OptionError, match="picklable"):
        compiled.serialize()


def test_an_equinox_module_as_the_function_keeps_its_arrays_out_of_the_bytes() -> None:
    mlp = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(1))
    x = jnp.ones(2)
    data = eqx_offload.filter_jit(mlp).lower(x).compile().serialize()
    other = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(2))
    assert jnp.array_equal(eqx_offload.filter_jit(other).load(data)(x),
                           eqx_offload.filter_jit(other)(x))


def mesh_round_trip() -> list[float]:
    """A step over two devices, not the first and not in id order, saved and loaded (in a
    child: a program loaded on its devices in another order aborts the process)."""
    devices = jax.devices()[2:4][::-1]
    sharded = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("d",)),
                                         jax.sharding.PartitionSpec("d"))
    model = {"w": jax.device_put(jnp.arange(8.0), sharded)}
    step = eqx_offload.filter_jit(_step)
    data = step.lower(model, jnp.float32(3)).compile().serialize()
    out = step.load(data)(model, jnp.float32(3))["w"]
    assert out.sharding == sharded
    result: list[float] = out.tolist()
    return result


def test_a_step_over_a_mesh_loads_on_the_mesh_devices_in_order() -> None:
    assert result_of(run_isolated(mesh_round_trip)) == [3.0 * i for i in range(8)]


def load_refused(path: str) -> str:
    """The error of loading the bytes at `path` (in a child with two devices)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        eqx_offload.filter_jit(_step).load(data)
    except OptionError as e:
        return str(e)
    return "loaded"


def test_bytes_for_devices_this_process_lacks_are_refused(tmp_path: Path) -> None:
    on_sixth = jax.device_put(jnp.ones(3), jax.devices()[5])
    path = tmp_path / "step.bin"
    path.write_bytes(eqx_offload.filter_jit(_step).lower({"w": on_sixth}, jnp.float32(2))
                     .compile().serialize())
    error = result_of(run_isolated(load_refused, str(path),
                                   env={"JAX_NUM_CPU_DEVICES": "2"}))
    assert "devices [5]" in error and "has [0, 1]" in error, error

"""Every documented offload mode compiles for a TPU v5e (without one), and XLA:TPU's
memory analysis shows the bytes where the docs say: a small Llama-style decoder
(bench/llama.py: RMSNorm, rotary attention, SwiGLU, stacked blocks run by `scan_layers`)
lowered through `eqx_offload.filter_jit(...).lower_for(("tpu",), ...)` from abstract
arguments whose shardings are on the topology's device (their memory kinds kept)."""

import json
import pathlib
import sys
from typing import Any

import equinox as eqx
import jax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_offload
from helpers import TPU_ENV
from isolated import run_isolated


# (The child of `analyses` imports this file with tests/ alone on its path.)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from v5e_steps import OTHER_MODELS, STEPS  # (beside this file)


pytestmark = pytest.mark.both  # (libtpu pins its JAX: both environments)


def compile_for(device: Any, name: str) -> Any:
    """`STEPS[name]` compiled for `device`: its arguments abstract, each leaf's sharding
    on `device` in the memory kind of the array it stands for. Returns XLA:TPU's memory
    analysis."""
    step, args = STEPS[name]()
    mesh = Mesh([device], ("x",))

    def abstract(x: Any) -> Any:
        if not eqx.is_array(x):
            return x
        sharding = NamedSharding(mesh, P(), memory_kind=x.sharding.memory_kind)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    lowered = eqx_offload.filter_jit(step, donate="all").lower_for(
        ("tpu",), jax.tree.map(abstract, args), {})
    return lowered.compile().memory_analysis()


# XLA:TPU stops the process (a failed CHECK) on some programs it cannot compile, e.g. a
# one-row copy into a bf16 host buffer: the steps compile in a child process, which
# reports each step as it finishes; after an abort the next child goes on with the rest.
_FIELDS = ("argument_size_in_bytes", "temp_size_in_bytes", "host_argument_size_in_bytes",
           "host_temp_size_in_bytes")
_START, _DONE = "@@compiling@@", "@@compiled@@"


def compile_each(names: list[str]) -> None:
    """(In the child, with `TPU_ENV` set.) Compile each step for a v5e's first chip and
    print its memory analysis, or its error, one JSON line each."""
    from jax.experimental import topologies

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    for name in names:
        print(_START + name, flush=True)
        try:
            found = compile_for(device, name)
            result: Any = {f: getattr(found, f) for f in _FIELDS}
        except Exception as error:  # reported, and the next step compiles
            result = f"{type(error).__name__}: {error}"[:2000]
        print(_DONE + json.dumps([name, result]), flush=True)


# The child imports the package this process imported (a worktree's, not an installed one).
PACKAGE = str(pathlib.Path(eqx_offload.__file__).resolve().parents[1])


def analyses() -> dict[str, Any]:
    """Every step's memory analysis (a dict of `_FIELDS`) or its failure (a string), by
    name."""
    found: dict[str, Any] = {}
    remaining = list(STEPS)
    while remaining:
        child = run_isolated(compile_each, remaining, env={**TPU_ENV, "PYTHONPATH": PACKAGE})
        started = None
        for line in child.stdout.splitlines():
            if line.startswith(_START):
                started = line[len(_START):]
            elif line.startswith(_DONE):
                name, result = json.loads(line[len(_DONE):])
                found[name], started = result, None
        if started is not None or child.returncode != 0:
            lines = child.stderr.splitlines()
            tail = "\n".join([x for x in lines if "Check failed" in x][:1] or lines[-10:])
            found[started or remaining[0]] = (
                f"the compiler stopped the process (exit {child.returncode}):\n{tail}")
        remaining = [n for n in remaining if n not in found]
    return found


def test_every_mode_compiles_for_a_v5e_and_its_bytes_are_where_the_docs_say(tpu: Any) -> None:
    """Each mode compiles (in one child process, for its first chip: `compile_each`);
    XLA:TPU's memory analysis has its bytes where the docs say."""
    assert {m.kind for m in tpu.addressable_memories()} >= {"device", "pinned_host"}
    found = analyses()
    failed = {name: r for name, r in found.items() if isinstance(r, str)}
    assert not failed, "\n\n".join(f"{name}: {r}" for name, r in failed.items())
    _check_host_bytes(found)
    _check_device_bytes_fall(found)


def _check_host_bytes(found: dict[str, Any]) -> None:
    """What each mode keeps in host memory is there (host bytes of the arguments, or of
    the temporaries for the layer inputs), and the device holds fewer argument bytes
    than the plain step of the same decoder."""
    plain = found["plain"]["argument_size_in_bytes"]
    for name, m in found.items():
        if name == "plain":
            continue
        if name == "activations":
            assert m["host_temp_size_in_bytes"] > 0, name
            continue
        assert m["host_argument_size_in_bytes"] > 0, name
        assert name in OTHER_MODELS or m["argument_size_in_bytes"] < plain, name


def _check_device_bytes_fall(found: dict[str, Any]) -> None:
    """The streamed update needs fewer temporaries than the whole state at once;
    `host_dtype=bfloat16` halves the state's host bytes (to a tile's padding); weights
    in host memory leave the device fewer argument bytes than the state alone, bf16
    weights fewer than fp32; master weights with compute weights in host memory fewer
    than with them on the device."""
    def m(name: str, field: str = "argument_size_in_bytes") -> int:
        value: int = found[name][field]
        return value

    assert m("state", "temp_size_in_bytes") < m("state-whole", "temp_size_in_bytes")
    half, whole = m("state-bf16", "host_argument_size_in_bytes"), m(
        "state", "host_argument_size_in_bytes")
    assert abs(2 * half - whole) < whole / 100  # (a small leaf's tiles are padded)
    assert m("state-bf16") == m("state")
    assert m("params-fp32") < m("state")
    assert m("params-bf16") < m("params-fp32")
    assert m("master-params-bf16") < m("master") < m("state")

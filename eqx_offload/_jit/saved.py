"""A compiled `filter_jit` function as bytes, and back: `Compiled.serialize` and
`filter_jit(f).load`. A later process runs the step without tracing or compiling it.

The executable goes through `jax.experimental.serialize_executable` (as JAX writes its
persistent compilation cache: an executable for the same backend, device kind and JAX
version); what calls it (the call's `Signature`, the output's structure, the donation)
is pickled beside it, each device named by its id and found again in the loading
process."""

import functools
import importlib
import io
import pickle
import sys
import types
from typing import Any, Optional

import jax
from jax.experimental import serialize_executable

from .._core.errors import docs_link, OptionError
from .call import Signature
from .donation import Donation
from .stage import Executable

_DOCS = docs_link("startup.md", "load-the-compiled-step")


def _imported(module: str, name: str) -> Any:
    return functools.reduce(getattr, name.split("."), importlib.import_module(module))


def _module_name(obj: Any) -> Optional[str]:
    """The name under which `obj`'s module holds it (its qualified name, or a global of
    that module that is `obj`: `_identity = lambda x: x`), if any."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    name = getattr(obj, "__qualname__", None)
    if module is None:
        return None
    if isinstance(name, str) and "<" not in name:
        try:
            if _imported(module.__name__, name) is obj:
                return name
        except AttributeError:
            pass
    return next((k for k, v in vars(module).items() if v is obj), None)


_PLAIN = (bool, int, float, complex, str, bytes, tuple, list, dict, type(None))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return ("device", obj.id) if isinstance(obj, jax.Device) else None

    def reducer_override(self, obj: Any) -> Any:
        # An object by the name its module holds it under, where pickle would copy it or
        # fail: a sentinel (Equinox's `MISSING`, in a module's tree structure), `jax.nn.relu`
        # (a `custom_jvp`: pickle names the function it wraps), a module's lambda
        # (`eqx.nn.MLP`'s default `final_activation`), a function's type.
        if isinstance(obj, _PLAIN):
            return NotImplemented
        name = _module_name(obj)
        if isinstance(obj, (type, types.FunctionType)) and name == obj.__qualname__:
            return NotImplemented
        if name is not None:
            return _imported, (obj.__module__, name)
        # A static leaf's type that its module does not hold (`types.FunctionType`)
        name = next((k for k, v in vars(types).items() if v is obj), None)
        return NotImplemented if name is None else (_imported, ("types", name))


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, devices: dict[int, Any]) -> None:
        super().__init__(file)
        self._devices = devices

    def persistent_load(self, pid: Any) -> Any:
        return self._devices[pid[1]]


def _devices_of(compiled: Any) -> list[int]:
    """The ids of the devices `compiled` runs on, in the order of its device assignment
    (a mesh's, else the one device of its first input or output)."""
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    for s in shardings:
        if isinstance(s, jax.sharding.NamedSharding) and isinstance(s.mesh, jax.sharding.Mesh):
            return [d.id for d in s.mesh.devices.flat]
    devices = {d for s in shardings for d in s.device_set}
    return [d.id for d in sorted(devices, key=lambda d: d.id)] or [jax.devices()[0].id]


def dumps(executable: Executable, key: Signature, donate: Donation, name: str) -> bytes:
    """`executable` and what calls it, as bytes for `loads`."""
    file = io.BytesIO()
    header = (name, donate, _devices_of(executable.compiled))  # (what `loads` checks first)
    try:  # (the executable refused by JAX, or a value that does not pickle)
        payload, in_tree, out_tree = serialize_executable.serialize(executable.compiled)
        pickler = _Pickler(file)
        pickler.dump(header)
        pickler.dump((payload, in_tree, out_tree, executable.output, key))
    except (pickle.PicklingError, TypeError, AttributeError, ValueError,
            NotImplementedError) as e:
        raise OptionError(
            "Make the step's static arguments and outputs picklable (no lambdas, no local "
            "classes) and pass its arrays as arguments, or compile it in each process."
            f"\nfilter_jit({name}).lower(...).compile().serialize(): {e}\nSee {_DOCS}.") from e
    return file.getvalue()


def loads(data: bytes, name: str, donate: Donation) -> tuple[Executable, Signature]:
    """The executable of `dumps`' bytes, loaded on this process's devices, and its
    `Signature`; an `OptionError` where it was saved from another function or donation."""
    devices = {d.id: d for d in jax.devices()}
    unpickler = _Unpickler(io.BytesIO(data), devices)
    saved, saved_donate, ids = unpickler.load()
    if (saved, saved_donate) != (name, donate):
        raise OptionError(
            f"Load the bytes into the function they were saved from: `{saved}` with its "
            f"`donate`.\nfilter_jit({name}).load(data): saved from `{saved}`"
            f"{'' if saved_donate == donate else ' with another donate'}.\nSee {_DOCS}.")
    if not set(ids) <= devices.keys():
        raise OptionError(
            "Load the step in a process with the devices it was compiled for, or compile "
            f"it there.\nfilter_jit({name}).load(data): compiled for devices {ids}; this "
            f"process has {sorted(devices)}.\nSee {_DOCS}.")
    payload, in_tree, out_tree, output, key = unpickler.load()
    compiled = serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=[devices[i] for i in ids])
    return Executable(compiled, output), key

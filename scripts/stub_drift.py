"""Stub drift: fails when the shipped pytype stub of eqx_offload
(`typings/pytype/eqx_offload/__init__.pyi`) no longer matches the package.

The pytype stubs of the public API are written by hand (pytype users get no checking
without them, and the inline annotations are what mypy users read), so this check keeps
them honest:

1. `mypy.stubtest` imports `eqx_offload` and compares every name the stub declares
   with the runtime object: parameter names, kinds, defaults, overloads, classes and
   their members, dataclass fields.
2. The public names of `eqx_offload/__init__.py` (its `from ... import x as x`
   re-exports) and of the stub must be the same set (stubtest skips names re-exported
   from private modules, so a new public function without a stub would pass it).
3. Every `Literal` alias (`MemoryKind`, `Donate`, ...) has the same values in the stub
   and at runtime (stubtest cannot compare `Literal` aliases: it reports them all).

    python scripts/stub_drift.py        # exit status 1 on any difference
"""

import ast
import os
import pathlib
import subprocess
import sys
import tempfile
import typing
from collections.abc import Sequence
from typing import Optional


ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "eqx_offload"
STUBS = ROOT / "typings"
STUB = STUBS / "pytype" / PACKAGE / "__init__.pyi"
STUB_NAME = STUB.relative_to(ROOT)

# stubtest errors that are not drift, each with its reason. (Every `Literal` alias of
# the stub is added too: stubtest reads a `Literal[...]` alias in a stub as a union of
# literals and then reports the runtime `Literal` as "not a Union"; check 3 compares
# their values instead.)
ALLOWLIST = {
    f"{PACKAGE}.__main__": "the command line (`python -m eqx_offload`), not an API",
    rf"{PACKAGE}\.cli(\..+)?": "the command line's demo and benchmark, not an API",
}


def run_stubtest() -> tuple[bool, str]:
    """`mypy.stubtest eqx_offload` against the stub, with only the eqx_offload and optax
    stubs on the path (jax and equinox: their own inline types)."""
    with tempfile.TemporaryDirectory(prefix="stub-drift-") as tmp:
        stubs = pathlib.Path(tmp) / "stubs"
        stubs.mkdir()
        (stubs / PACKAGE).symlink_to(STUB.parent, target_is_directory=True)
        (stubs / "optax").symlink_to(STUBS / "mypy" / "optax", target_is_directory=True)
        allowlist = pathlib.Path(tmp) / "allowlist.txt"
        allowed = {**ALLOWLIST, **{
            f"{PACKAGE}.{name}": "Literal alias (compared by the literals check)"
            for name in stub_literals()
        }}
        allowlist.write_text("".join(f"{name}  # {why}\n" for name, why in allowed.items()))
        config = pathlib.Path(tmp) / "mypy.ini"
        config.write_text(
            f"[mypy]\npython_version = {sys.version_info.major}.{sys.version_info.minor}\n"
            f"cache_dir = {ROOT / '.mypy_cache' / 'stubtest'}\n"
        )
        proc = subprocess.run(
            [sys.executable, "-m", "mypy.stubtest", PACKAGE,
             "--allowlist", str(allowlist), "--mypy-config-file", str(config)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "MYPYPATH": str(stubs)},
        )
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def runtime_public_names() -> set[str]:
    """The names `eqx_offload/__init__.py` re-exports (`import x as x`), plus
    `__version__`."""
    tree = ast.parse((ROOT / PACKAGE / "__init__.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            names.update(a.asname for a in node.names if a.asname and a.asname == a.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_") or n == "__version__"}


def stub_public_names() -> set[str]:
    names = set()
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_") or n == "__version__"}


def stub_literals() -> dict[str, tuple[object, ...]]:
    """The `Name = Literal[...]` aliases of the stub and their values."""
    found = {}
    for node in ast.parse(STUB.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Subscript)
            and ast.unparse(node.value.value) in ("Literal", "typing.Literal")
        ):
            values = ast.literal_eval(node.value.slice)
            found[node.targets[0].id] = values if isinstance(values, tuple) else (values,)
    return found


def literal_differences() -> list[str]:
    sys.path.insert(0, str(ROOT))  # this checkout's package, not another installed one
    import eqx_offload

    problems = []
    for name, values in sorted(stub_literals().items()):
        runtime_value = getattr(eqx_offload, name, None)
        if typing.get_origin(runtime_value) is not typing.Literal:
            problems.append(f"{name}: the stub has a Literal, the runtime has {runtime_value!r}")
        elif values != typing.get_args(runtime_value):
            problems.append(
                f"{name}: stub {values} != runtime {typing.get_args(runtime_value)}"
            )
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    del argv
    failures = 0
    runtime, stub = runtime_public_names(), stub_public_names()
    missing, extra = sorted(runtime - stub), sorted(stub - runtime)
    if missing or extra:
        failures += 1
        print(f"[names] FAILED: {STUB_NAME} and {PACKAGE}/__init__.py differ")
        for n in missing:
            print(f"  public but not in the stub: {n}")
        for n in extra:
            print(f"  in the stub but not public: {n}")
    else:
        print(f"[names] ok: {len(runtime)} public names, all in the stub")

    problems = literal_differences()
    if problems:
        failures += 1
        print("[literals] FAILED:")
        for p in problems:
            print(f"  {p}")
    else:
        print("[literals] ok")

    ok, output = run_stubtest()
    if ok:
        print("[stubtest] ok")
    else:
        failures += 1
        print(f"[stubtest] FAILED:\n{output}")
    print(f"\nstub drift: {'FAILED' if failures else 'ok'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

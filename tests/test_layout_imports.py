"""The package's layers import in one direction only: each subpackage imports from the
ones before it in `LAYERS`, never from one after it (docs/architecture.md draws the map).
Read from the source, imports inside functions included. The scripts of `bench/` import
the public API only."""

import ast
import pathlib

import pytest


PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "eqx_offload"
# Lowest first. The top level (""): `__init__`, `_runtime`, `_stubs`. The command line
# (`cli` and `__main__`) is on the public API only (tests/cli/test_cli.py).
LAYERS = ["_core", "_jit", "_stream", "_optim", "_models", "_plan", "", "cli"]


def _layer(parts: tuple[str, ...]) -> str:
    """The layer of a module, from its dotted path below `eqx_offload`."""
    if not parts:
        return ""
    head = parts[0]
    if head == "__main__":
        return "cli"
    return head if head in LAYERS else ""


def _module_parts(path: pathlib.Path) -> tuple[str, ...]:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imported(path: pathlib.Path) -> list[tuple[int, tuple[str, ...]]]:
    """(line, module parts below `eqx_offload`) of every import of the package."""
    here = _module_parts(path)
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = base + tuple((node.module or "").split(".")) if node.module else base
            elif node.module and node.module.split(".")[0] == "eqx_offload":
                target = tuple(node.module.split(".")[1:])
            else:
                continue
            target = tuple(p for p in target if p)
            if node.module is None:  # `from . import x`: the modules named
                found += [(node.lineno, target + (a.name,)) for a in node.names]
            else:
                found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, tuple(a.name.split(".")[1:])) for a in node.names
                      if a.name.split(".")[0] == "eqx_offload"]
    return found


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = LAYERS.index(_layer(_module_parts(path)))
        for line, target in _imported(path):
            theirs = LAYERS.index(_layer(target))
            if theirs > mine:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports "
                           f"eqx_offload.{'.'.join(target)} (layer {LAYERS[theirs] or 'top'} "
                           f"above {LAYERS[mine] or 'top'})")
    return bad


def test_imports_go_one_way() -> None:
    assert _violations() == []


def test_every_module_is_in_a_layer() -> None:
    """A new subpackage is placed in `LAYERS` (and on the map of docs/architecture.md)."""
    folders = {p.name for p in PACKAGE.iterdir()
               if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= set(LAYERS), folders - set(LAYERS)
    architecture = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for folder in folders:
        assert f"`{folder}/`" in architecture, folder


def test_the_check_can_fail(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An import from a later layer is reported."""
    fake = tmp_path / "eqx_offload"
    (fake / "_core").mkdir(parents=True)
    (fake / "_core" / "__init__.py").write_text("")
    (fake / "_core" / "bad.py").write_text("def f():\n    from .._optim.state import x\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert _violations() == ["eqx_offload/_core/bad.py:2 imports eqx_offload._optim.state "
                             "(layer _optim above _core)"]


def _test_imports(folder: pathlib.Path) -> list[str]:
    """`file:line module` for every import of a test module (`test_*`) by a test file."""
    found = []
    for path in sorted(folder.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(folder)}:{node.lineno} {name}" for name in names
                      if name.split(".")[-1].startswith("test_")]
    return found


def test_no_test_file_imports_another(tmp_path: pathlib.Path) -> None:
    """The tests mirror the subpackages, and what several share is in `tests/helpers.py`."""
    assert _test_imports(pathlib.Path(__file__).resolve().parent) == []
    (tmp_path / "test_a.py").write_text("from test_b import x\n")
    assert _test_imports(tmp_path) == ["test_a.py:1 test_b"]


def _private_imports(folder: pathlib.Path) -> list[str]:
    """`file:line module` for every import of a private module or name of the package
    (a part that starts with `_`) by a script of `folder`, its dated `results/` aside."""
    found = []
    for path in sorted(p for p in folder.rglob("*.py")
                       if "results" not in p.relative_to(folder).parts):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.relative_to(folder)}:{node.lineno} {name}" for name in names
                      if name.split(".")[0] == "eqx_offload"
                      and any(p.startswith("_") for p in name.split(".")[1:])]
    return found


def test_no_bench_script_imports_a_private_module(tmp_path: pathlib.Path) -> None:
    """`bench/` runs on the public API only (its dated `results/` folders aside)."""
    assert _private_imports(PACKAGE.parent / "bench") == []
    (tmp_path / "a.py").write_text("import eqx_offload\nfrom eqx_offload._models.make import f\n")
    assert _private_imports(tmp_path) == ["a.py:2 eqx_offload._models.make.f"]

"""Every module of the package at most 500 lines, every class at most 200 (docstrings
included), every function's code (its docstring aside) at most 60: read with `ast`, so a
long class or function shows by name. `bench/` at most 2,500 lines of scripts."""

import ast
import pathlib

import pytest


PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "eqx_offload"
MODULE_LINES = 500
FUNCTION_LINES = 60
CLASS_LINES = 200
# Modules or functions over the limits, each with its reason (none now).
EXCEPTIONS: dict[str, str] = {}


def oversized(source: str, name: str) -> list[str]:
    """`name` if `source` is over `MODULE_LINES`, `name:class` for each class over
    `CLASS_LINES` and `name:function` for each function whose code is over
    `FUNCTION_LINES` lines."""
    found = [name] if len(source.splitlines()) > MODULE_LINES else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno is not None
            if node.end_lineno - node.lineno + 1 > CLASS_LINES:
                found.append(f"{name}:{node.name}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and (
                    isinstance(first.value.value, str)):
                assert first.end_lineno is not None
                lines -= first.end_lineno - first.lineno + 1
            if lines > FUNCTION_LINES:
                found.append(f"{name}:{node.name}")
    return found


def test_measure_can_fail() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES))
    assert oversized(f'def f():\n    """doc\n    more"""\n{body}', "m") == ["m:f"]
    assert oversized(f"def f():\n{body[:-len('    x59 = 59')-1]}", "m") == []
    assert oversized("x = 1\n" * (MODULE_LINES + 1), "m") == ["m"]
    fields = "".join(f"    x{i} = {i}\n" for i in range(CLASS_LINES))
    assert oversized(f"class C:\n{fields}", "m") == ["m:C"]
    assert oversized(f"class C:\n{fields[:-len('    x199 = 199')-1]}", "m") == []


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_and_function_sizes(path: pathlib.Path) -> None:
    name = str(path.relative_to(PACKAGE))
    over = [n for n in oversized(path.read_text(), name) if n not in EXCEPTIONS]
    assert not over, (f"over {MODULE_LINES} lines a module, {CLASS_LINES} a class or "
                      f"{FUNCTION_LINES} a function: {over}")


BENCH = PACKAGE.parent / "bench"
BENCH_LINES = 2500


def test_bench_is_at_most_its_budget() -> None:
    """`bench/`'s scripts (its `.py` and `.sh`, dated `results/` folders aside: those are
    data) at most `BENCH_LINES` lines in all."""
    scripts = [p for p in BENCH.rglob("*") if p.suffix in (".py", ".sh")
               and "results" not in p.relative_to(BENCH).parts]
    assert scripts
    total = sum(len(p.read_text().splitlines()) for p in scripts)
    assert total <= BENCH_LINES, f"bench/ has {total} lines of scripts, over {BENCH_LINES}"

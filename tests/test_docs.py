"""The `python` fences of each docs page and public docstring run in order in one namespace
(`py` fences are shown only); the package's commands in shell fences parse."""

import argparse
import contextlib
import inspect
import io
import pathlib
import re
import shlex
import sys
import textwrap
import types
from typing import Any

import pytest
from helpers import gpu_plan_marks, tpu_plan_marks

import eqx_offload


pytestmark = pytest.mark.once

ROOT = pathlib.Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """`(line number, language, code)` of each fenced block, dedented (as in admonitions)."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        language = m["info"].strip().split(" ")[0].lstrip("{.").rstrip("}")
        start = j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence[0] * len(fence))
            and lines[j].strip().strip(fence[0]) == ""
            and len(lines[j]) - len(lines[j].lstrip()) <= len(indent)
        ):
            j += 1
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                         for line in lines[start:j])
        blocks.append((start + 1, language, textwrap.dedent(body)))
        i = j + 1
    return blocks


def _page_id(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def python_blocks(text: str) -> list[tuple[int, str]]:
    return [(line, code) for line, lang, code in code_blocks(text) if lang == "python"]


_PAGES = sorted((ROOT / "docs").rglob("*.md"))
_PAGES_WITH_CODE = [p for p in _PAGES if python_blocks(p.read_text())]


def _run_blocks(blocks: list[tuple[int, str]], where: str) -> None:
    # (a module of its own, importable while it runs, as a script's `__main__` is: what
    # it defines pickles by name, as `Compiled.serialize` needs)
    module = types.ModuleType("__docs__")
    sys.modules["__docs__"] = module
    try:
        for line, code in blocks:  # running the documentation is the point
            exec(compile(code, f"{where}:{line}", "exec"), module.__dict__)  # noqa: S102
    finally:
        del sys.modules["__docs__"]


# (pages and examples that compile for a GPU or a TPU: skipped, saying why, where that
# compiler is not released for the installed JAX)
_COMPILES_FOR = {"docs/gpu-plan.md": gpu_plan_marks, "plan": tpu_plan_marks}


def _params(items: list[Any], ids: Any = str) -> list[Any]:
    return [pytest.param(x, id=ids(x), marks=_COMPILES_FOR.get(ids(x), list)())
            for x in items]


@pytest.mark.parametrize("page", _params(_PAGES_WITH_CODE, _page_id))
def test_page_code_blocks_run(page):
    _run_blocks(python_blocks(page.read_text()), _page_id(page))


def _public_docstrings() -> dict[str, str]:
    docs = {}
    for name in (n for n in sorted(dir(eqx_offload)) if not n.startswith("_")):
        obj = getattr(eqx_offload, name)
        if callable(obj) and obj.__doc__:  # a class is callable
            docs[name] = inspect.cleandoc(obj.__doc__)
        for attr, member in vars(obj).items() if inspect.isclass(obj) else ():
            if not attr.startswith("_") and callable(member) and member.__doc__:
                docs[f"{name}.{attr}"] = inspect.cleandoc(member.__doc__)
    return docs


_DOCSTRINGS = {name: python_blocks(doc) for name, doc in _public_docstrings().items()}
_DOCSTRINGS_WITH_CODE = sorted(name for name, blocks in _DOCSTRINGS.items() if blocks)


@pytest.mark.parametrize("name", _params(_DOCSTRINGS_WITH_CODE))
def test_docstring_examples_run(name):
    _run_blocks(_DOCSTRINGS[name], f"eqx_offload.{name}.__doc__")


# ------------------------------------------------------------ the documented commands
_SHELL_LANGUAGES = {"bash", "sh", "shell", "console", "zsh"}
# `[path/]python3 -m eqx_offload ARGS`, `eqx-offload ARGS`, `bench/gpu_run.sh ARGS` (to
# `bench`), `bench/capacity_run.py ARGS` (the script's own parser, as `capacity_run`);
# ARGS end at a shell operator, `)` or a backtick.
_COMMAND = re.compile(
    r"(?:(?<![\w.-])\S*python3?(?:\.\d+)?\s+-m\s+eqx_offload|(?<![\w.-])eqx-offload"
    r"|(?P<gpu_run>bench/gpu_run\.sh)|(?P<capacity>bench/capacity_run\.py))(?![\w.-])"
    r"(?P<args>[^;&|)`\n]*)")


def shell_commands(text: str) -> list[tuple[int, list[str]]]:
    """`(line, argv)` of each package command in shell blocks: lines joined, `$ `, `#` dropped."""
    found = []
    for line, language, code in code_blocks(text):
        if language not in _SHELL_LANGUAGES:
            continue
        joined = re.sub(r"\\\n", " ", code)
        for offset, command in enumerate(joined.splitlines()):
            command = re.sub(r"^\s*\$ ", "", command)
            for m in _COMMAND.finditer(command):
                argv = shlex.split(m["args"], comments=True)
                head = ["bench"] if m["gpu_run"] else ["capacity_run"] if m["capacity"] else []
                found.append((line + offset, [*head, *argv]))
    return found


def parse_command(argv: list[str]) -> str:
    """`argv` parsed as `python -m eqx_offload` would, not run: "" or argparse's message."""
    from eqx_offload.cli import _parser

    if argv[:1] == ["capacity_run"]:
        sys.path.insert(0, str(ROOT / "bench"))
        import capacity_run

        parser = argparse.ArgumentParser()
        capacity_run.add_capacity_arguments(parser)
        parser.add_argument("--platform")
        argv = argv[1:]
    else:
        parser = _parser()[0]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exit_:
        if exit_.code not in (0, None):  # `--help` exits 0
            # argparse's last line is the error; the usage above it is long
            return (stderr.getvalue().strip().splitlines() or [f"exit {exit_.code}"])[-1]
    return ""


_DOCUMENTS_WITH_COMMANDS = [p for p in [ROOT / "README.md", *_PAGES]
                            if shell_commands(p.read_text())]


@pytest.mark.parametrize("document", _DOCUMENTS_WITH_COMMANDS, ids=_page_id)
def test_documented_commands_parse(document):
    errors = [f"{_page_id(document)}:{line}: eqx_offload {shlex.join(argv)}: {error}"
              for line, argv in shell_commands(document.read_text())
              if (error := parse_command(argv))]
    assert not errors, "\n".join(errors)


def test_extractors_are_not_blind_and_a_failing_block_or_stale_command_fails():
    text = ("```bash\npython -m eqx_offload bench --out x \\\n    --modes baseline  # a comment\n"
            ".venv/bin/python3 -m eqx_offload demo && eqx-offload plan --capacity\n"
            "MYPYPATH=$(python -m eqx_offload typings --mypy) mypy train.py\n"
            "OUT=/tmp/x bash bench/gpu_run.sh --platform cpu\npython -m eqx_offload_other demo\n"
            "python bench/capacity_run.py --quick\n"
            "```\n```python\nprint('python -m eqx_offload demo')\n```\n")
    assert [argv for _, argv in shell_commands(text)] == [
        ["bench", "--out", "x", "--modes", "baseline"], ["demo"], ["plan", "--capacity"],
        ["typings", "--mypy"], ["bench", "--platform", "cpu"], ["capacity_run", "--quick"]]
    assert parse_command(["capacity_run", "--quick", "--gpus", "h100"]) == ""
    assert "unrecognized arguments" in parse_command(["capacity_run", "--no-such-option"])
    assert "unrecognized arguments" in parse_command(["plan", "--capacity"])
    ids = {_page_id(p) for p in _DOCUMENTS_WITH_COMMANDS}
    for document in ("README.md", "docs/getting-started.md", "docs/benchmark.md",
                     "docs/gpu-plan.md", "docs/typing.md"):
        assert document in ids, document
    assert parse_command(["demo", "--steps", "3"]) == parse_command(["bench", "--help"]) == ""
    assert "invalid choice" in parse_command(["bench", "--modes", "no_such_mode"])
    assert "unrecognized arguments" in parse_command(["plan", "--no-such-option"])
    assert parse_command(["no_such_command"]) != ""
    text = ("intro\n```python\nx = 1\n```\n\n!!! Example\n\n    ```python\n    y = x + 1\n"
            "    ```\n\n```bash\nexit 1\n```\n```py\nraise SystemExit\n```\n")
    assert [(lang, code) for _, lang, code in code_blocks(text)] == [
        ("python", "x = 1"), ("python", "y = x + 1"), ("bash", "exit 1"),
        ("py", "raise SystemExit")]
    pages = {_page_id(p) for p in _PAGES_WITH_CODE}
    for page in ("docs/index.md", "docs/getting-started.md", "docs/concepts.md",
                 "docs/how-to/training-loop.md", "docs/how-to/select.md",
                 "docs/how-to/gradient-accumulation.md"):
        assert page in pages, page
    for name in ("to_host", "offloaded", "filter_jit", "memory_report", "pattern"):
        assert name in _DOCSTRINGS_WITH_CODE, name
    with pytest.raises(AssertionError):
        _run_blocks([(1, "assert 1 + 1 == 3")], "inline")

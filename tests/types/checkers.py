"""Runs the four static checkers over `tests/types/` the way `docs/typing.md` tells a user
to, and writes the table "what each checker catches" that the docs include.

    python scripts/checker_table.py                 # rerun the checkers, rewrite the table
    python scripts/checker_table.py --markers-only  # rewrite it from the markers alone

(`tests/test_types.py` runs each checker against the markers, one test per checker, and
checks that the committed table is the markers' table.)

Each checker runs on copies of the files in a fresh folder (a user's project, not this
repository, whose `mypy.ini` pyrefly would import):

- mypy: `mypy --strict` with `mypy_path = $(python -m eqx_offload typings --mypy)`;
- pytype: `pytype-single --pythonpath=$(python -m eqx_offload typings) FILE`;
- pyright: `pyright FILES`, no configuration;
- pyrefly: `pyrefly check FILES` with an empty `pyrefly.toml` (pyrefly's default preset,
  what `pyrefly init` starts from; without any configuration file pyrefly falls back to
  its `basic` preset, which reports almost none of the mistakes).

Every line of a `bad_*.py` file marked `# expect: mypy=CODE pytype=CODE ...` is a mistake;
a checker named there must report it with that code, a checker not named there must not
report it (so a checker that starts catching it makes the table stale, and
`tests/test_types.py` fails until the marker and the table are updated).
"""

import argparse
import collections
import concurrent.futures
import functools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Optional


ROOT = pathlib.Path(__file__).resolve().parent.parent
TYPES = ROOT / "tests" / "types"
GOOD = TYPES / "good_usage.py"
TABLE = ROOT / "docs" / "typing-checkers.txt"
CHECKERS = ("mypy", "pytype", "pyright", "pyrefly")
# pytype's last release runs on Python <= 3.12.
PYTYPE_RUNS = sys.version_info < (3, 13)

Errors = dict[str, set[tuple[int, str]]]  # file name -> {(line, code)}

_EXPECT = re.compile(r"#\s*expect:\s*(?P<spec>((mypy|pytype|pyright|pyrefly)=[A-Za-z-]+\s*)+)$")
_MYPY_ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")
_PYTYPE_ERROR = re.compile(r"^(?P<file>[^:\s]+):(?P<line>\d+):(?P<col>\d+): .*\[(?P<code>[a-z-]+)\]$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def bad_files() -> list[pathlib.Path]:
    return sorted(TYPES.glob("bad_*.py"))


def expected_errors(path: pathlib.Path) -> dict[str, set[tuple[int, str]]]:
    """{checker: {(line, code)}} from the `# expect:` comments of `path`."""
    found: dict[str, set[tuple[int, str]]] = {c: set() for c in CHECKERS}
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        match = _EXPECT.search(text)
        if match is None:
            continue
        for item in match["spec"].split():
            checker, _, code = item.partition("=")
            found[checker].add((number, code))
    return found


def mistakes(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, what) of every marked mistake of `path`: the comment just above it says
    what the mistake is."""
    lines = path.read_text().splitlines()
    out = []
    for number, text in enumerate(lines, start=1):
        if _EXPECT.search(text) is None:
            continue
        comment = []
        above = number - 2
        while above >= 0 and lines[above].strip().startswith("#"):
            comment.insert(0, lines[above].strip().lstrip("#").strip())
            above -= 1
        out.append((number, " ".join(comment) or text.split("#")[0].strip()))
    return out


def _tool(name: str) -> list[str]:
    exe = shutil.which(name, path=str(pathlib.Path(sys.executable).parent))
    if exe is None:
        raise SystemExit(f"{name} is not installed in this environment (pip install -e '.[dev]')")
    return [exe]


@functools.cache
def stub_paths() -> tuple[str, str]:
    """(pytype's `--pythonpath`, mypy's `mypy_path`) as `python -m eqx_offload typings`
    prints them for the installed package (asked once per process: each asking is a
    Python that imports jax, 1.5 CPU-seconds)."""
    def ask(*extra: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "eqx_offload", "typings", *extra],
            capture_output=True, text=True, check=True,
        ).stdout.strip()

    return ask(), ask("--mypy")


def _activated() -> dict[str, str]:
    """The environment of a shell in which this venv is activated: pyright and pyrefly
    find the interpreter (and so the installed packages) on `PATH`."""
    bin_dir = str(pathlib.Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "VIRTUAL_ENV": sys.prefix}


def _project(files: Sequence[pathlib.Path], tmp: pathlib.Path, name: str) -> list[pathlib.Path]:
    folder = tmp / name
    folder.mkdir()
    for f in files:
        shutil.copy(f, folder / f.name)
    return [folder / f.name for f in files]


def run_mypy(files: Sequence[pathlib.Path], tmp: pathlib.Path, mypy_path: str) -> Errors:
    copies = _project(files, tmp, "mypy")
    config = tmp / "mypy.ini"
    config.write_text(f"[mypy]\nstrict = True\nmypy_path = {mypy_path}\n"
                      f"cache_dir = {tmp / 'mypy-cache'}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--no-error-summary",
         "--hide-error-context", "--no-pretty", *map(str, copies)],
        capture_output=True, text=True, cwd=copies[0].parent,
    )
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"mypy failed:\n{proc.stdout}{proc.stderr}")
    errors: Errors = collections.defaultdict(set)
    for line in proc.stdout.splitlines():
        match = _MYPY_ERROR.match(line)
        if match is not None:
            errors[pathlib.Path(match["file"]).name].add((int(match["line"]), match["code"]))
        elif ": note: " not in line and line.strip():
            raise RuntimeError(f"unparsed mypy output: {line}")
    return errors


def run_pytype(files: Sequence[pathlib.Path], tmp: pathlib.Path, pythonpath: str) -> Errors:
    copies = _project(files, tmp, "pytype")

    # The typeshed modules parsed once for the run, where scripts/check.sh made them
    # (scripts/pytype_gate.py: the same errors, a third of the time per file).
    builtins = os.environ.get("EQX_OFFLOAD_PYTYPE_BUILTINS")
    faster = [f"--precompiled-builtins={builtins}"] if builtins else []

    def one(path: pathlib.Path) -> tuple[str, set[tuple[int, str]]]:
        proc = subprocess.run(
            [*_tool("pytype-single"), *faster, f"--pythonpath={pythonpath}", "--color=never",
             str(path)],
            capture_output=True, text=True, cwd=path.parent,
        )
        output = _ANSI.sub("", proc.stdout + proc.stderr)
        found = {
            (int(m["line"]), m["code"])
            for m in map(_PYTYPE_ERROR.match, output.splitlines()) if m is not None
        }
        if proc.returncode not in (0, 1) or (proc.returncode == 1 and not found):
            raise RuntimeError(f"pytype failed on {path.name}:\n{output}")
        return path.name, found

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        return collections.defaultdict(set, dict(pool.map(one, copies)))


def run_pyright(files: Sequence[pathlib.Path], tmp: pathlib.Path, config: str = "") -> Errors:
    copies = _project(files, tmp, "pyright")
    if config:
        (copies[0].parent / "pyrightconfig.json").write_text(config)
    proc = subprocess.run(
        [*_tool("pyright"), "--outputjson", *map(str, copies)],
        capture_output=True, text=True, cwd=copies[0].parent, env=_activated(),
    )
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"pyright failed:\n{proc.stdout}{proc.stderr}")
    errors: Errors = collections.defaultdict(set)
    for d in json.loads(proc.stdout)["generalDiagnostics"]:
        if d["severity"] == "error":
            errors[pathlib.Path(d["file"]).name].add(
                (d["range"]["start"]["line"] + 1, d.get("rule", "error")))
    return errors


def run_pyrefly(
    files: Sequence[pathlib.Path], tmp: pathlib.Path, config: str = ""
) -> Errors:
    copies = _project(files, tmp, "pyrefly")
    toml = copies[0].parent / "pyrefly.toml"
    toml.write_text(config)
    proc = subprocess.run(
        [*_tool("pyrefly"), "check", "--config", str(toml), "--output-format", "json",
         *map(str, copies)],
        capture_output=True, text=True, cwd=copies[0].parent, env=_activated(),
    )
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"pyrefly failed:\n{proc.stdout}{proc.stderr}")
    errors: Errors = collections.defaultdict(set)
    for e in json.loads(proc.stdout)["errors"]:
        if e.get("severity", "error") == "error":
            errors[pathlib.Path(e["path"]).name].add((e["line"], e["name"]))
    return errors


def run_checkers(
    files: Sequence[pathlib.Path], checkers: Sequence[str] = CHECKERS
) -> dict[str, Errors]:
    """{checker: {file name: {(line, code)}}}, each run as docs/typing.md says."""
    pythonpath, mypy_path = stub_paths()
    out = {}
    with tempfile.TemporaryDirectory(prefix="checkers-") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        for checker in checkers:
            if checker == "mypy":
                out[checker] = run_mypy(files, tmp, mypy_path)
            elif checker == "pytype":
                out[checker] = run_pytype(files, tmp, pythonpath)
            elif checker == "pyright":
                out[checker] = run_pyright(files, tmp)
            else:
                out[checker] = run_pyrefly(files, tmp)
    return out


def problems_of(results: dict[str, Errors]) -> list[str]:
    """What differs from the `# expect:` markers (and from a clean `good_usage.py`)."""
    problems = []
    for checker, errors in results.items():
        good = errors.get(GOOD.name, set())
        if good:
            problems.append(f"{checker}: {GOOD.name}: errors {sorted(good)}")
        for path in bad_files():
            expected = expected_errors(path)[checker]
            got = errors.get(path.name, set())
            if got - expected:
                problems.append(f"{checker}: {path.name}: unexpected {sorted(got - expected)}")
            if expected - got:
                problems.append(f"{checker}: {path.name}: missed {sorted(expected - got)}")
    return problems


def render(results: dict[str, Errors]) -> str:
    """The Markdown table: one row per marked mistake, one column per checker."""
    header = "| file:line | mistake | " + " | ".join(CHECKERS) + " |"
    rows = [header, "|" + " --- |" * (2 + len(CHECKERS))]
    totals = dict.fromkeys(CHECKERS, 0)
    count = 0
    for path in bad_files():
        for line, what in mistakes(path):
            count += 1
            cells = []
            for checker in CHECKERS:
                codes = sorted(c for n, c in results[checker].get(path.name, set()) if n == line)
                if codes:
                    totals[checker] += 1
                cells.append(", ".join(f"`{c}`" for c in codes) if codes else "—")
            rows.append(f"| `{path.name}:{line}` | {what} | " + " | ".join(cells) + " |")
    rows.append(f"| **caught** | **of {count}** | "
                + " | ".join(f"**{totals[c]}**" for c in CHECKERS) + " |")
    return "\n".join(rows) + "\n"


def table_from_markers() -> str:
    """The table the `# expect:` markers describe (equal to `render` of a real run
    whenever `problems_of` finds nothing)."""
    results: dict[str, Errors] = {c: collections.defaultdict(set) for c in CHECKERS}
    for path in bad_files():
        for checker, found in expected_errors(path).items():
            results[checker][path.name] |= found
    return render(results)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markers-only", action="store_true",
                        help="write the table from the markers, without running checkers")
    args = parser.parse_args(argv)
    if not args.markers_only:
        checkers = CHECKERS if PYTYPE_RUNS else tuple(c for c in CHECKERS if c != "pytype")
        results = run_checkers([GOOD, *bad_files()], checkers)
        problems = problems_of(results)
        if problems:
            print("the checkers disagree with the # expect: markers; fix the markers first:")
            print("\n".join(f"  {p}" for p in problems))
            return 1
    TABLE.write_text(table_from_markers())
    print(f"wrote {TABLE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The four static checkers over copies of `tests/types/`, as docs/typing.md runs them; a
`bad_*.py` line marked `# expect: mypy=CODE ...` must be reported by exactly those checkers.

    python tests/types/checkers.py                 # rerun the checkers, rewrite the table
    python tests/types/checkers.py --markers-only  # rewrite it from the markers alone
"""

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


ROOT = pathlib.Path(__file__).resolve().parents[2]
TYPES = ROOT / "tests" / "types"
GOOD = TYPES / "good_usage.py"
BAD = sorted(TYPES.glob("bad_*.py"))
TABLE = ROOT / "docs" / "typing-checkers.txt"
CHECKERS = ("mypy", "pytype", "pyright", "pyrefly")
PYTYPE_RUNS = sys.version_info < (3, 13)  # pytype's last release runs on Python <= 3.12
Errors = dict[str, set[tuple[int, str]]]  # file name -> {(line, code)}

_EXPECT = re.compile(r"#\s*expect:\s*((?:(?:mypy|pytype|pyright|pyrefly)=[A-Za-z-]+\s*)+)$")
_ERROR = re.compile(r"^([^:\s]+):(\d+):(?:\d+:)? .*\[([a-z-]+)\]$")  # mypy's and pytype's
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def expected_errors(path: pathlib.Path) -> dict[str, set[tuple[int, str]]]:
    """{checker: {(line, code)}} from the `# expect:` comments of `path`."""
    found: dict[str, set[tuple[int, str]]] = {c: set() for c in CHECKERS}
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if match := _EXPECT.search(text):
            for checker, _, code in (item.partition("=") for item in match[1].split()):
                found[checker].add((number, code))
    return found


@functools.cache
def stub_paths() -> tuple[str, str]:
    """(pytype's `--pythonpath`, mypy's `mypy_path`) as `python -m eqx_offload typings` prints."""
    def ask(*extra: str) -> str:
        return subprocess.run([sys.executable, "-m", "eqx_offload", "typings", *extra],
                              capture_output=True, text=True, check=True).stdout.strip()
    return ask(), ask("--mypy")


def run(checker: str, files: list[pathlib.Path], tmp: pathlib.Path, config: str = "") -> Errors:
    """The errors `checker` reports on copies of `files` (`config`: pyright's or pyrefly's)."""
    folder = tmp / checker
    folder.mkdir()
    names = [shutil.copy(f, folder / f.name) and f.name for f in files]
    bin_dir = pathlib.Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": sys.prefix}
    if checker == "mypy":
        (folder / "mypy.ini").write_text(f"[mypy]\nstrict = True\nmypy_path = {stub_paths()[1]}\n"
                                         f"cache_dir = {tmp / 'mypy-cache'}\n")
        commands = [[sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-pretty",
                     "--no-error-summary", "--hide-error-context", *names]]
    elif checker == "pytype":
        commands = [[str(bin_dir / "pytype-single"), f"--pythonpath={stub_paths()[0]}",
                     "--color=never", n] for n in names]
    elif checker == "pyright":
        if config:
            (folder / "pyrightconfig.json").write_text(config)
        commands = [["pyright", "--outputjson", *names]]
    else:  # pyrefly: an empty pyrefly.toml is its default preset (none: the `basic` one)
        (folder / "pyrefly.toml").write_text(config)
        commands = [["pyrefly", "check", "--config", "pyrefly.toml", "--output-format", "json", *names]]
    errors: Errors = collections.defaultdict(set)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda c: subprocess.run(c, capture_output=True, text=True,
                                                       cwd=folder, env=env), commands))
    for proc in procs:
        if checker == "pyright":
            found = [(d["file"], d["range"]["start"]["line"] + 1, d.get("rule", "error"))
                     for d in json.loads(proc.stdout)["generalDiagnostics"] if d["severity"] == "error"]
        elif checker == "pyrefly":
            found = [(e["path"], e["line"], e["name"]) for e in json.loads(proc.stdout)["errors"]
                     if e.get("severity", "error") == "error"]
        else:
            output = _ANSI.sub("", proc.stdout + proc.stderr).splitlines()
            found = [(m[1], int(m[2]), m[3]) for m in map(_ERROR.match, output) if m]
        if proc.returncode not in (0, 1) or (proc.returncode == 1 and not found):
            raise RuntimeError(f"{checker} failed:\n{proc.stdout}{proc.stderr}")
        for file, line, code in found:
            errors[pathlib.Path(file).name].add((line, code))
    return errors


def run_checkers(files: list[pathlib.Path], checkers: tuple[str, ...] = CHECKERS) -> dict[str, Errors]:
    with tempfile.TemporaryDirectory(prefix="checkers-") as tmp:
        return {c: run(c, files, pathlib.Path(tmp)) for c in checkers}


def problems_of(results: dict[str, Errors]) -> list[str]:
    """What differs from the `# expect:` markers (and from a clean `good_usage.py`)."""
    problems = [f"{c}: {GOOD.name}: {sorted(e[GOOD.name])}" for c, e in results.items() if e.get(GOOD.name)]
    for checker, errors in results.items():
        for path in BAD:
            expected, got = expected_errors(path)[checker], errors.get(path.name, set())
            problems += [f"{checker}: {path.name}: unexpected {sorted(got - expected)}"] * bool(got - expected)
            problems += [f"{checker}: {path.name}: missed {sorted(expected - got)}"] * bool(expected - got)
    return problems


def table_from_markers() -> str:
    """A row per marked mistake (the comment above says what), a column per checker's codes."""
    rows = ["| file:line | mistake | " + " | ".join(CHECKERS) + " |", "|" + " --- |" * (2 + len(CHECKERS))]
    totals = dict.fromkeys(CHECKERS, 0)
    for path in BAD:
        lines, expected = path.read_text().splitlines(), expected_errors(path)
        for number, text in enumerate(lines, start=1):
            if not _EXPECT.search(text):
                continue
            above = number - 2
            while above >= 0 and lines[above].strip().startswith("#"):
                above -= 1
            what = " ".join(t.strip().lstrip("#").strip() for t in lines[above + 1: number - 1])
            cells = [", ".join(f"`{c}`" for n, c in sorted(expected[k]) if n == number) or "—"
                     for k in CHECKERS]
            totals.update({k: totals[k] + (cell != "—") for k, cell in zip(CHECKERS, cells)})
            rows.append(f"| `{path.name}:{number}` | {what or text.split('#')[0].strip()} | "
                        + " | ".join(cells) + " |")
    rows.append(f"| **caught** | **of {len(rows) - 2}** | " + " | ".join(f"**{totals[c]}**" for c in CHECKERS) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if "--markers-only" not in sys.argv:
        checkers = CHECKERS if PYTYPE_RUNS else tuple(c for c in CHECKERS if c != "pytype")
        if problems := problems_of(run_checkers([GOOD, *BAD], checkers)):
            sys.exit("the checkers disagree with the # expect: markers:\n  " + "\n  ".join(problems))
    TABLE.write_text(table_from_markers())
    print(f"wrote {TABLE.relative_to(ROOT)}")

"""The pytype gate: pytype over every module of `eqx_offload`, with the shipped stubs.

A plain `pytype eqx_offload` maps `jax`, `equinox`, `optax` and `jaxtyping` to an empty
stub (everything `Any`), so it checks nothing about calls into them. This gate runs
`pytype-single` on each module with `--pythonpath=<generated>:<stubs>`: the stubs the
wheel ships (`typings/`, what `python -m eqx_offload typings` prints) stand
for the third-party packages, `scripts/pytype_stubs/` for the few that only the
command line and the runtime checks use (rich, matplotlib, beartype: not shipped, users'
code is not checked against them), and the `.pyi` that pytype infers for each module of
the package stands for it
when later modules import it (modules run in dependency order, those whose dependencies
are done in parallel).

    python scripts/pytype_gate.py            # every module of eqx_offload
    python scripts/pytype_gate.py -j 1 eqx_offload/_move.py
    python scripts/pytype_gate.py --check-file tests/types/good_usage.py

`--check-file` checks a user script against the *shipped stubs* only (which hold the
stub of `eqx_offload` itself), as a downstream project would. Exit status 1 on any error.

Why not the `pytype` command with a `[tool.pytype]` section (as Optax runs it): the
command orders the modules with importlab, whose resolver finds only `.py` files on the
`pythonpath` (`importlab/resolve.py`, `_find_file`); jax, equinox, jaxtyping and optax
then resolve to their installed sources, count as "System" modules, and pytype maps them
to an empty `default.pyi` (everything `Any`). Tried: with the shipped stubs on its
`pythonpath`, `pytype` passes a module that returns `jax.local_devices()` from a
function annotated `-> str`, which this gate rejects. pytype-single, run here, reads the
`.pyi` stubs from `--pythonpath` itself.

Every pytype-single process would parse typeshed again (about 3 of a small module's 5
seconds), so the gate hands them pytype's `--precompiled-builtins`: the typeshed modules
(standard library, `tqdm`, ...) that the package, the stubs and `tests/types/` import,
with what they import, parsed once and pickled as pytype's own `--generate-builtins`
does for all of typeshed (which takes over two minutes). A module missing from it is an
import-error, never a silent `Any`. `--write-builtins FILE` writes it for several runs
(scripts/check.sh makes one, exported as $EQX_OFFLOAD_PYTYPE_BUILTINS, for the gate and
the tests that run pytype).

Each module is checked by what `pytype-single` runs (`pytype.io.process_one_file` on the
same command-line options), called in a worker process that imported pytype once: a
`pytype-single` process spends about half a second of a small module's second importing
pytype. pytype supports such long-lived callers (`process_one_file` drops each file's
analysis for them); every file still gets a loader of its own, as in a `pytype-single`
process, so nothing that one module's check loads reaches the next.
"""

import argparse
import ast
import concurrent.futures
import contextlib
import io
import logging
import multiprocessing
import os
import pathlib
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import NamedTuple, Optional


ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "eqx_offload"
# The stubs the wheel ships (the folders `eqx_offload._stubs.pytype_path()` names) and
# the gate-only ones, relative to this checkout (not to an installed eqx_offload: the
# gate's own tests run it on a modified copy of the repository).
SHIPPED_STUBS = [ROOT / "typings" / "pytype", ROOT / "typings" / "mypy"]
GATE_STUBS = ROOT / "scripts" / "pytype_stubs"
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"

# pytype's opt-in strictness features that are stable enough to gate on.
STRICT_FLAGS: tuple[str, ...] = (
    "--analyze-annotated",
    "--none-is-not-bool",
    "--strict-none-binding",
    "--strict-parameter-checks",
    "--strict-primitive-comparisons",
    "--overriding-renamed-parameter-count-checks",
) + tuple(os.environ.get("PYTYPE_GATE_FLAGS", "").split())

_ERROR_LINE = re.compile(r"^(?P<file>[^:\s]+):(?P<line>\d+):(?P<col>\d+): .*\[(?P<code>[a-z-]+)\]$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


BUILTINS_VARIABLE = "EQX_OFFLOAD_PYTYPE_BUILTINS"
# What pytype itself reads beyond a module's own imports (its overlays). Not
# `_typeshed`: loaded first by name, its pickled `typing.Never` cannot be restored
# ("This should not happen"); loaded as the stubs' dependency, it can.
_BASE_MODULES = ("builtins", "typing", "typing_extensions", "collections", "collections.abc",
                 "abc", "enum", "types", "dataclasses", "functools")


# typeshed modules whose pickled form pytype cannot read back (tqdm's stubs:
# "msgspec.ValidationError: Expected `object`, got `None`"): a module that imports one
# runs without the precompiled builtins, reading typeshed as a plain run does.
UNPICKLED = frozenset({"tqdm"})


class Result(NamedTuple):
    target: str
    returncode: int
    output: str
    seconds: float


class _CurrentStderr:
    """A stream that writes to whatever `sys.stderr` is at the time: pytype's logging
    handler, set up once per process, then follows each file's captured output."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _start_worker() -> None:
    os.chdir(ROOT)
    logging.basicConfig(stream=_CurrentStderr())  # (pytype's own basicConfig is then a no-op)


def _pytype_single(argv: list[str]) -> tuple[int, str]:
    """`pytype-single ARGV`, in this process: its exit status and its output."""
    from pytype import config, io as pytype_io  # (imported by `Workers` before the fork)

    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            rc = pytype_io.process_one_file(config.Options(argv, command_line=True))
        except SystemExit as e:  # a usage error: pytype-single prints it and exits
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 (as pytype-single: the traceback, exit status 1)
            traceback.print_exc()
            rc = 1
    return rc, output.getvalue()


class Workers:
    """`jobs` worker processes that run `pytype-single`'s entry point. pytype is imported
    here first, and the workers are forked at once (before any thread of the gate
    starts), so each has it."""

    def __init__(self, jobs: int) -> None:
        import pytype.config
        import pytype.io  # noqa: F401

        self.pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=jobs, mp_context=multiprocessing.get_context("fork"),
            initializer=_start_worker)
        self.pool.submit(int).result()  # forks all the workers (a fork pool starts them together)

    def run(self, argv: list[str]) -> tuple[int, str]:
        return self.pool.submit(_pytype_single, argv).result()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown()


def builtin_sources() -> list[pathlib.Path]:
    """The files whose typeshed imports the precompiled builtins hold."""
    return [*(ROOT / PACKAGE).rglob("*.py"), *(ROOT / "typings").rglob("*.pyi"),
            *GATE_STUBS.rglob("*.pyi"), *(ROOT / "tests" / "types").glob("*.py")]


def typeshed_imports(paths: Sequence[pathlib.Path]) -> set[str]:
    """The modules that `paths` import (absolute imports, full names) that typeshed may
    hold: all but the package's and those the stub folders hold."""
    names = set(_BASE_MODULES).union(*map(imported_modules, paths))
    ours = {PACKAGE} | {p.stem for d in [*SHIPPED_STUBS, GATE_STUBS] for p in d.iterdir()}
    return {n for n in names
            if n.split(".")[0] not in ours | UNPICKLED and n != "_typeshed"}


def write_builtins(target: pathlib.Path, sources: Sequence[pathlib.Path]) -> pathlib.Path:
    """pytype's precompiled builtins for `sources` (what `pytype-single
    --generate-builtins` writes, for these modules and their imports only)."""
    from pytype import config, load_pytd  # (imported here: only this function needs pytype)

    loader = load_pytd.create_loader(config.Options.create(
        python_version=sys.version_info[:2]))
    for name in sorted(typeshed_imports(sources)):
        loader.import_name(name)  # None for a name typeshed lacks: pytype reports it
    target.parent.mkdir(parents=True, exist_ok=True)
    loader.save_to_pickle(str(target))
    return target


def builtins_pickle(directory: pathlib.Path, sources: Sequence[pathlib.Path]) -> pathlib.Path:
    """$EQX_OFFLOAD_PYTYPE_BUILTINS if it names a file, else a new pickle in `directory`."""
    given = os.environ.get(BUILTINS_VARIABLE)
    if given and pathlib.Path(given).is_file():
        return pathlib.Path(given)
    return write_builtins(directory / "builtins.pickle", sources)


def module_name(path: pathlib.Path) -> str:
    """The dotted name of a module of the package; `pkg.__init__` for a package (as
    pytype wants it, so that relative imports in `__init__.py` resolve)."""
    return ".".join(path.resolve().relative_to(ROOT).with_suffix("").parts)


def package_modules() -> list[pathlib.Path]:
    return sorted((ROOT / PACKAGE).rglob("*.py"))


def imported_modules(path: pathlib.Path) -> set[str]:
    """The modules `path` imports, full names; relative imports resolved in modules of
    the package (and left out elsewhere). `from eqx_offload.x import name` also counts
    `eqx_offload.x.name`, which may be a submodule."""
    in_package = path.resolve().is_relative_to(ROOT / PACKAGE)
    package = module_name(path).rpartition(".")[0] if in_package else ""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level and not in_package:
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                absolute = ".".join(base + ([node.module] if node.module else []))
            else:
                absolute = node.module or ""
            found.add(absolute)
            if absolute == PACKAGE or absolute.startswith(PACKAGE + "."):
                found.update(f"{absolute}.{a.name}" for a in node.names)
    return found - {""}


def local_imports(path: pathlib.Path) -> set[str]:
    """The modules of the package that `path` imports (relative or absolute)."""
    return {n for n in imported_modules(path) if n.split(".")[0] == PACKAGE}


def import_cycles(
    paths: Sequence[pathlib.Path],
) -> dict[tuple[pathlib.Path, ...], set[tuple[pathlib.Path, ...]]]:
    """The import cycles (strongly connected components; most are one module) of
    `paths`, each with the cycles it imports."""
    by_name = {module_name(p).removesuffix(".__init__"): p for p in paths}
    deps = {n: {d for d in local_imports(p) if d in by_name and d != n} for n, p in by_name.items()}
    # Tarjan's strongly connected components.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[tuple[str, ...]] = []

    def visit(n: str) -> None:
        index[n] = low[n] = len(index)
        stack.append(n)
        for d in sorted(deps[n]):
            if d not in index:
                visit(d)
                low[n] = min(low[n], low[d])
            elif d in stack:
                low[n] = min(low[n], index[d])
        if low[n] == index[n]:
            component = []
            while True:
                m = stack.pop()
                component.append(m)
                if m == n:
                    break
            components.append(tuple(sorted(component)))

    for n in sorted(by_name):
        if n not in index:
            visit(n)
    component_of = {n: c for c in components for n in c}

    def paths_of(c: tuple[str, ...]) -> tuple[pathlib.Path, ...]:
        return tuple(by_name[n] for n in c)

    return {
        paths_of(c): {paths_of(component_of[d]) for n in c for d in deps[n]} - {paths_of(c)}
        for c in components
    }


def run_one(
    workers: Workers,
    path: pathlib.Path,
    pythonpath: Sequence[pathlib.Path],
    output: Optional[pathlib.Path],
    builtins: pathlib.Path,
    report: bool = True,
) -> Result:
    plain = any(n.split(".")[0] in UNPICKLED for n in imported_modules(path))
    command = [
        "-V=" + PYTHON_VERSION,
        *([] if plain else ["--precompiled-builtins=" + str(builtins)]),
        "--module-name=" + (module_name(path) if path.is_relative_to(ROOT / PACKAGE) else path.stem),
        "--pythonpath=" + os.pathsep.join(str(p) for p in pythonpath),
        "--color=never",
        *STRICT_FLAGS,
    ]
    if not report:
        command.append("--no-report-errors")
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        command.append("--output=" + str(output))
    command.append(str(path))
    start = time.perf_counter()
    returncode, text = workers.run(command)
    return Result(
        str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
        returncode,
        _ANSI.sub("", text),
        time.perf_counter() - start,
    )


def errors_of(output: str) -> list[tuple[int, str]]:
    """(line, error code) of every error in pytype's output."""
    return [
        (int(m["line"]), m["code"])
        for m in map(_ERROR_LINE.match, output.splitlines())
        if m is not None
    ]


def check_package(paths: Sequence[pathlib.Path], jobs: int) -> list[Result]:
    """pytype over `paths` (modules of the package) in dependency order."""
    all_modules = package_modules()
    wanted = {p.resolve() for p in paths}
    results = []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="pytype-gate-"))
        generated = pathlib.Path(tmp) / "pyi"
        pythonpath = [generated, *SHIPPED_STUBS, GATE_STUBS]
        builtins = builtins_pickle(pathlib.Path(tmp), builtin_sources())
        workers = stack.enter_context(Workers(jobs))

        def output(p: pathlib.Path) -> pathlib.Path:
            return generated / pathlib.Path(*module_name(p).split(".")).with_suffix(".pyi")

        def run_cycle(cycle: tuple[pathlib.Path, ...]) -> list[Result]:
            if len(cycle) > 1:
                # As the `pytype` tool does: a first pass without error reports writes a
                # .pyi for each module of the cycle (its imports of the others are
                # unresolved); the second pass reads them.
                for p in cycle:
                    run_one(workers, p, pythonpath, output(p), builtins, report=False)
            return [run_one(workers, p, pythonpath, output(p), builtins) for p in cycle]

        # Each cycle starts as soon as the cycles it imports are done. Modules that are
        # not asked for still run (later ones need their .pyi); their errors are not
        # reported.
        graph = import_cycles(all_modules)
        # Only the cycles of the wanted modules and what they import (transitively).
        needed = {c for c in graph if any(p.resolve() in wanted for p in c)}
        frontier = set(needed)
        while frontier:
            frontier = {d for c in frontier for d in graph[c]} - needed
            needed |= frontier
        graph = {c: deps for c, deps in graph.items() if c in needed}

        def depth(cycle: tuple[pathlib.Path, ...]) -> int:
            """The longest chain of cycles that import `cycle`: start those first."""
            return max((1 + depth(c) for c, deps in graph.items() if cycle in deps), default=0)

        order = sorted(graph, key=depth, reverse=True)
        done: set[tuple[pathlib.Path, ...]] = set()
        running: dict[concurrent.futures.Future[list[Result]], tuple[pathlib.Path, ...]] = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            while len(done) < len(graph):
                for cycle in order:
                    if cycle not in done and cycle not in running.values() and graph[cycle] <= done:
                        running[pool.submit(run_cycle, cycle)] = cycle
                finished, _ = concurrent.futures.wait(
                    running, return_when=concurrent.futures.FIRST_COMPLETED
                )
                for future in finished:
                    done.add(running.pop(future))
                    results.extend(r for r in future.result() if (ROOT / r.target).resolve() in wanted)
    unchecked = wanted - {(ROOT / r.target).resolve() for r in results}
    if unchecked:
        raise SystemExit(f"pytype gate: not modules of {PACKAGE}: {sorted(map(str, unchecked))}")
    return sorted(results, key=lambda r: r.target)


def check_files(paths: Sequence[pathlib.Path], jobs: int) -> list[Result]:
    """pytype over user scripts, against the shipped stubs only."""
    with tempfile.TemporaryDirectory(prefix="pytype-gate-") as tmp:
        builtins = builtins_pickle(pathlib.Path(tmp), [*builtin_sources(), *paths])
        with Workers(jobs) as workers, concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            return list(pool.map(lambda p: run_one(workers, p, SHIPPED_STUBS, None, builtins),
                                 paths))


def report(results: Sequence[Result], total_seconds: float) -> int:
    failed = [r for r in results if r.returncode != 0 or errors_of(r.output)]
    for r in results:
        n = len(errors_of(r.output))
        status = "ok" if r not in failed else f"FAILED ({n} error{'s' * (n != 1)})"
        print(f"  {r.target:<40} {status:<22} {r.seconds:5.1f} s")
    for r in failed:
        print(f"\n--- {r.target} ---\n{r.output.strip()}")
    print(
        f"\npytype gate: {len(results)} file(s), {len(failed)} failed, "
        f"{total_seconds:.1f} s wall"
    )
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=pathlib.Path,
                        help="modules of eqx_offload to check (default: all)")
    parser.add_argument("--check-file", action="append", type=pathlib.Path, default=[],
                        help="a user script to check against the public stubs")
    parser.add_argument("-j", "--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--write-builtins", type=pathlib.Path, metavar="FILE",
                        help="only write the precompiled builtins to FILE (see above)")
    args = parser.parse_args(argv)
    if args.write_builtins:
        write_builtins(args.write_builtins.resolve(), builtin_sources())
        return 0
    start = time.perf_counter()
    results: list[Result] = []
    if args.files or not args.check_file:
        results += check_package(args.files or package_modules(), args.jobs)
    if args.check_file:
        results += check_files([p.resolve() for p in args.check_file], args.jobs)
    return report(results, time.perf_counter() - start)


if __name__ == "__main__":
    sys.exit(main())

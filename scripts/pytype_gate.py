"""pytype over the modules of eqx_offload, against the stubs the wheel ships.

    python scripts/pytype_gate.py [FILE...]   # all modules, or FILE and what it imports

`pytype-single` per module, two at a time, each after the modules it imports (their
inferred `.pyi` on its `--pythonpath`, with `typings/` for jax, equinox, optax and
jaxtyping and `scripts/pytype_stubs/` for rich, matplotlib, beartype and flax); an import
cycle runs twice, the first pass only writing its `.pyi`. Exit status 1 on any error. Not the
`pytype` command: it maps every installed package to an empty stub (everything `Any`),
stubs on its `--pythonpath` or not. typeshed's modules are parsed once, for every run
(`--precompiled-builtins`), except for modules that import tqdm, whose stub pytype cannot
pickle.
"""

import ast
import concurrent.futures
import contextlib
import pathlib
import subprocess
import sys
import tempfile


ROOT = pathlib.Path(__file__).resolve().parent.parent
STUBS = [ROOT / "typings" / "pytype", ROOT / "typings" / "mypy", ROOT / "scripts" / "pytype_stubs"]
FLAGS = ["--analyze-annotated", "--none-is-not-bool", "--strict-none-binding",
         "--strict-parameter-checks", "--strict-primitive-comparisons",
         "--overriding-renamed-parameter-count-checks", "--color=never",
         f"-V={sys.version_info.major}.{sys.version_info.minor}"]


def name(path: pathlib.Path) -> str:
    """`eqx_offload.cli.__init__` for a package: pytype resolves its relative imports so."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imports(path: pathlib.Path) -> set[str]:
    """What `path` imports, full names (`from eqx_offload.m import n` also counts `m.n`)."""
    package = name(path).split(".")[:-1] if path.suffix == ".py" else None
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (package is not None or not node.level):
            base = package[: len(package) - node.level + 1] if node.level and package else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {module} | {f"{module}.{a.name}" for a in node.names if module.startswith("eqx")}
    return found


def write_builtins(target: pathlib.Path) -> None:
    """The typeshed modules that the package and the stubs import, parsed and pickled."""
    from pytype import config, load_pytd

    sources = [*(ROOT / "eqx_offload").rglob("*.py"), *(ROOT / "tests" / "types").glob("*.py"),
               *(p for d in STUBS for p in d.rglob("*.pyi"))]
    ours = {"eqx_offload", "tqdm"} | {p.name for d in STUBS for p in d.iterdir()}
    names = {"builtins", "typing", "typing_extensions", "collections.abc", "enum", "types",
             "dataclasses", "functools"}.union(*map(imports, sources))
    loader = load_pytd.create_loader(config.Options.create(python_version=sys.version_info[:2]))
    for module in sorted(names):
        if module.split(".")[0] not in ours and module != "_typeshed":
            loader.import_name(module)
    loader.save_to_pickle(str(target))


def main(wanted: list[pathlib.Path]) -> int:
    stack = contextlib.ExitStack()
    pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(2))
    paths = sorted((ROOT / "eqx_offload").rglob("*.py"))
    by_name = {name(p).removesuffix(".__init__"): p for p in paths}
    deps = {p: {by_name[m] for m in imports(p) if m in by_name} - {p} for p in paths}
    needed, frontier = set(wanted or paths), set(wanted or paths)
    while frontier:
        frontier = set().union(*(deps[p] for p in frontier)) - needed
        needed |= frontier
    tmp = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pytype-gate-")))
    write_builtins(tmp / "builtins.pickle")

    def check(path: pathlib.Path, report: bool = True) -> tuple[int, str]:
        pyi = tmp / pathlib.Path(*name(path).split(".")).with_suffix(".pyi")
        pyi.parent.mkdir(parents=True, exist_ok=True)
        plain = any(m.split(".")[0] == "tqdm" for m in imports(path))
        proc = subprocess.run(
            [pathlib.Path(sys.executable).parent / "pytype-single", *FLAGS,
             *([] if plain else [f"--precompiled-builtins={tmp / 'builtins.pickle'}"]),
             f"--pythonpath={':'.join(map(str, [tmp, *STUBS]))}", f"--module-name={name(path)}",
             f"--output={pyi}", *([] if report else ["--no-report-errors"]), str(path)],
            capture_output=True, text=True, cwd=ROOT)
        return proc.returncode, proc.stdout + proc.stderr

    pending, done, running, failed = set(needed), set(), {}, 0
    with pool:
        while pending or running:
            ready = sorted(p for p in pending if deps[p] <= done)
            if not ready and not running:  # an import cycle: each module's .pyi first
                list(pool.map(lambda p: check(p, report=False), pending))
                ready = sorted(pending)
            pending -= set(ready)
            running.update({pool.submit(check, p): p for p in ready})
            finished, _ = concurrent.futures.wait(running, return_when="FIRST_COMPLETED")
            for future in finished:
                path = running.pop(future)
                done.add(path)
                rc, output = future.result()
                if path in (wanted or paths) and rc:
                    failed += 1
                    print(f"--- {path.relative_to(ROOT)}: FAILED\n{output.strip()}")
    stack.close()
    print(f"pytype gate: {len(wanted or paths)} module(s), {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([pathlib.Path(a).resolve() for a in sys.argv[1:]]))

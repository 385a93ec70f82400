"""mypy, pytype, pyright and pyrefly over `tests/types/` report exactly the `# expect:` lines;
the wheel ships the stubs, the docs' commands work, the gates can fail."""

import ast
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import typing
import tomllib
import zipfile
from typing import Any

import jax.numpy as jnp
import pytest

import eqx_offload


def _load(path: pathlib.Path) -> Any:
    """The file imported as a module (in `sys.modules`, as an import puts it: what it
    defines pickles by name)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


TABLE = _load(pathlib.Path(__file__).resolve().parent / "types" / "checkers.py")
ROOT, TYPES, GOOD, BAD, CHECKERS = TABLE.ROOT, TABLE.TYPES, TABLE.GOOD, TABLE.BAD, TABLE.CHECKERS
SUBMODULES = ("checkpoint", "errors", "memory", "remat", "stream", "types")
DOCS = ROOT / "docs" / "typing.md"
once = pytest.mark.once
needs_pytype = pytest.mark.skipif(
    not TABLE.PYTYPE_RUNS, reason="pytype's last release runs on Python <= 3.12")


@once
@pytest.mark.slow
@pytest.mark.parametrize(
    "checker", [pytest.param(c, marks=needs_pytype) if c == "pytype" else c for c in CHECKERS])
def test_checker_reports_exactly_the_expected_errors(checker: str) -> None:
    results = TABLE.run_checkers([GOOD, *BAD], [checker])
    assert TABLE.problems_of(results) == []


@once
@pytest.mark.slow
def test_optax_stub_gives_pyright_and_pyrefly_no_false_errors(tmp_path: pathlib.Path) -> None:
    """With the optax stub neither rejects correct code nor reports a line not a mistake."""
    _, mypy_path = TABLE.stub_paths()
    configs = {"pyright": f'{{"stubPath": "{mypy_path}"}}',
               "pyrefly": f'search-path = ["{mypy_path}"]\n'}
    for checker, config in configs.items():
        errors = TABLE.run(checker, [GOOD, *BAD], tmp_path, config)
        assert errors.get(GOOD.name, set()) == set(), checker
        for path in BAD:
            marked = {line for c in CHECKERS for line, _ in TABLE.expected_errors(path)[c]}
            stray = {e for e in errors.get(path.name, set()) if e[0] not in marked}
            assert stray == set(), (checker, path.name, stray)


@once
def test_typings_command_prints_the_stub_folders() -> None:
    pytype_path, mypy_path = TABLE.stub_paths()  # `python -m eqx_offload typings [--mypy]`
    pytype_path = pytype_path.split(os.pathsep)
    assert pathlib.Path(eqx_offload.__file__).parent.parent == ROOT  # a source checkout
    assert pytype_path == [str(ROOT / "typings" / "pytype"), mypy_path]
    assert mypy_path == str(ROOT / "typings" / "mypy")
    # mypy's folder holds optax only (another stub would shadow real inline types).
    assert sorted(p.name for p in pathlib.Path(mypy_path).iterdir()) == ["optax"]
    assert sorted(p.name for p in pathlib.Path(pytype_path[0]).iterdir()) == [
        "equinox", "eqx_offload", "jax", "jaxtyping"]
    # pyright's default stub path `typings/` is pointed elsewhere: no shadowing.
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pyright"] == {
        "stubPath": "typings/pyright"}
    assert not (ROOT / "typings" / "pyright").exists()


@once
def test_docs_table_is_generated_from_the_markers() -> None:
    """The markers are what each checker is held to: the table is their real result."""
    assert TABLE.TABLE.read_text() == TABLE.table_from_markers(), (
        "docs/typing-checkers.txt is stale: python tests/types/checkers.py")
    assert '--8<-- "typing-checkers.txt"' in DOCS.read_text()


@once
def test_bad_usage_covers_the_listed_mistakes() -> None:
    expected = {p.name: TABLE.expected_errors(p) for p in BAD}
    mistakes = {(p, line) for p, e in expected.items() for c in CHECKERS for line, _ in e[c]}
    assert len(mistakes) >= 8
    text = "\n".join(p.read_text() for p in BAD)
    for needle in ('memory_kind="gpu"', "offloaded(optax.adam)", "offloaded(model)",
                   "opt.update(grads, opt, params)", 'donate="everything"', 'where=".*/w"',
                   "where=1024", 'return "mu"', "assert isinstance(state, eqx_offload.Offloaded",
                   "if isinstance(state, eqx_offload.OffloadedState)"):
        assert needle in text, needle
    for checker in CHECKERS:  # each has a mistake in every file; misses at most 3 of all
        assert all(e[checker] for e in expected.values()), checker
        caught = {(p, line) for p, e in expected.items() for line, _ in e[checker]}
        assert len(caught) >= len(mistakes) - 3, checker
    # pytype reports mistakes after `assert isinstance(state, OffloadedState)`.
    pytype_lines = {line for line, _ in expected["bad_narrowing.py"]["pytype"]}
    assert len(pytype_lines) >= 3
    text = (TYPES / "bad_narrowing.py").read_text().splitlines()
    assert_line = next(i for i, t in enumerate(text, 1) if t.startswith("assert isinstance"))
    branch_line = next(i for i, t in enumerate(text, 1) if "if isinstance(state" in t)
    assert {n for n in pytype_lines if n > assert_line}
    assert {n for n in pytype_lines if n > branch_line}


@once
def test_good_usage_uses_every_public_name() -> None:
    public = set(eqx_offload.__all__) | {"__version__"} | {  # (each object once)
        f"{m}.{n}" for m in SUBMODULES for n in getattr(eqx_offload, m).__all__
        if n not in eqx_offload.__all__}
    text = GOOD.read_text()
    used = set(re.findall(r"eqx_offload\.(\w+)", text))
    used |= set(re.findall(r"eqx_offload\.(\w+\.\w+)", text))
    for module, names in re.findall(r"from eqx_offload(?:\.(\w+))? import ([\w, ]+)", text):
        used |= {f"{module}.{n.strip()}" if module else n.strip() for n in names.split(",")}
    assert public - used == set()


def test_good_usage_runs() -> None:
    assert jnp.isfinite(_load(GOOD).train(steps=2))


def _copy_repo(tmp_path: pathlib.Path) -> pathlib.Path:
    for name in ("eqx_offload", "scripts", "typings"):
        shutil.copytree(ROOT / name, tmp_path / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.slow
@needs_pytype
@once
def test_pytype_gate_fails_on_a_type_error(tmp_path: pathlib.Path) -> None:
    repo = _copy_repo(tmp_path)
    memory = repo / "eqx_offload" / "_core" / "memory.py"
    source = memory.read_text()
    assert "\ndef default_device() -> Device:\n" in source
    memory.write_text(source + "\n\ndef _broken() -> str:\n    return jax.local_devices()\n")
    proc = subprocess.run([sys.executable, str(repo / "scripts" / "pytype_gate.py"), str(memory)],
                          capture_output=True, text=True, cwd=repo)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "eqx_offload/_core/memory.py: FAILED" in proc.stdout
    assert "[bad-return-type]" in proc.stdout


@once
def test_all_is_every_reexport() -> None:
    """stubtest holds the stub to `__all__`; `__all__` is every `from ._x import a as a`
    (the public submodules, `from . import m as m`, are not in it)."""
    init = ast.parse((ROOT / "eqx_offload" / "__init__.py").read_text()).body
    reexports = {a.name for node in init if isinstance(node, ast.ImportFrom) and node.level
                 and node.module for a in node.names if a.asname == a.name}
    assert sorted(eqx_offload.__all__) == sorted(reexports)
    assert len(set(eqx_offload.__all__)) == len(eqx_offload.__all__)


@once
def test_stub_literals_have_the_runtime_values() -> None:
    """The `Literal` aliases stubtest cannot compare (its allowlist) are compared here."""
    text = (ROOT / "typings" / "pytype" / "eqx_offload" / "types.pyi").read_text()
    stub = {node.targets[0].id: ast.literal_eval(node.value.slice) for node in ast.parse(text).body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript)
            and ast.unparse(node.value.value) == "Literal"}
    assert sorted(stub) == ["Compute", "Donate", "HostMemoryKind", "MemoryKind"]
    allowed = (ROOT / "typings" / "stubtest-allowlist.txt").read_text().split()
    for name, values in stub.items():
        assert f"eqx_offload.types.{name}" in allowed
        assert typing.get_args(getattr(eqx_offload.types, name)) == values, name


@once
@pytest.mark.slow
def test_stub_drift_fails_when_a_signature_changes(tmp_path: pathlib.Path) -> None:
    repo = _copy_repo(tmp_path)
    shutil.copy(ROOT / "mypy.ini", repo / "mypy.ini")
    move = repo / "eqx_offload" / "_core" / "move.py"
    source = move.read_text()
    old = "def to_device(tree: _T, where: Where = True) -> _T:"
    assert old in source
    move.write_text(source.replace(old, "def to_device(tree: _T, where: Where = True, *, "
                                        "donate: bool = False) -> _T:"))
    init = repo / "eqx_offload" / "__init__.py"
    init.write_text(init.read_text() + "\nfrom ._core.move import move as move\n__all__ += ['move']\n")
    typings = repo / "typings"  # the stub-drift gate of scripts/gates.sh
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "eqx_offload", "--allowlist",
         str(typings / "stubtest-allowlist.txt"), "--mypy-config-file", str(repo / "mypy.ini")],
        capture_output=True, text=True, cwd=repo, timeout=600,
        env={**os.environ, "PYTHONPATH": str(repo),
             "MYPYPATH": f"{typings / 'pytype'}{os.pathsep}{typings / 'mypy'}"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "eqx_offload.move is not present in stub" in out
    assert "eqx_offload.to_device is inconsistent" in out and "donate" in out


def _docs_block(containing: str) -> str:
    """The fenced code block of docs/typing.md that contains `containing`."""
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", DOCS.read_text(), flags=re.S)
    found = [b for b in blocks if containing in b]
    assert len(found) == 1, f"docs/typing.md: {len(found)} blocks contain {containing!r}"
    return found[0]


def _site_packages(prefix: pathlib.Path) -> pathlib.Path:
    return prefix / "lib" / "python{}.{}".format(*sys.version_info[:2]) / "site-packages"


@once
@pytest.mark.slow
def test_wheel_ships_the_stubs_and_the_docs_commands_work(tmp_path: pathlib.Path) -> None:
    dist = tmp_path / "dist"
    has_uv = importlib.util.find_spec("uv") is not None  # else pip: the same hatchling build
    build = ([sys.executable, "-m", "uv", "build", "--wheel", "-q", "-o", str(dist)] if has_uv
             else [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist)])
    subprocess.run([*build, str(ROOT)], check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = dist.glob("eqx_offload-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".pyi")}
    stubs = ROOT / "typings"
    assert shipped == {f"eqx_offload/.typings/{p.relative_to(stubs)}" for p in stubs.rglob("*.pyi")}
    assert "eqx_offload/.typings/mypy/optax/__init__.pyi" in shipped
    assert "eqx_offload/.typings/pytype/jax/__init__.pyi" in shipped

    # A fresh venv with the wheel and the checkers; dependencies through a .pth line.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", *(["--without-pip"] if has_uv else []),
                    str(venv)], check=True, timeout=300)
    tools = ["mypy==2.4.1", "pyright==1.1.414", "pyrefly==1.5.0"]
    tools += ["pytype==2024.10.11"] if TABLE.PYTYPE_RUNS else []
    install = ([sys.executable, "-m", "uv", "pip", "install", "--python", str(venv / "bin/python")]
               if has_uv else [str(venv / "bin" / "python"), "-m", "pip", "install"])
    subprocess.run([*install, "--no-deps", "-q", str(wheel), *tools],
                   check=True, capture_output=True, text=True, timeout=600)
    # (After the install, or pip would find the tools installed and write no scripts.)
    deps = _site_packages(pathlib.Path(sys.prefix))
    (_site_packages(venv) / "_dev_deps.pth").write_text(f"{deps}\n")
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "VIRTUAL_ENV": str(venv), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("PYTHONPATH", None)  # a checkout on the path would stand in for the wheel

    def python(*args: str) -> str:
        return subprocess.run(["python", *args], capture_output=True, text=True, env=env,
                              check=True, cwd=tmp_path).stdout.strip()

    where = python("-c", "import eqx_offload; print(eqx_offload.__file__)")
    assert where.startswith(str(_site_packages(venv))), where  # the wheel, not the checkout
    # mypy refuses a mypy_path in site-packages: a copy in the cache, the same each call.
    printed = [python("-m", "eqx_offload", "typings", "--mypy") for _ in range(2)]
    assert printed[0] == printed[1] and printed[0].startswith(str(tmp_path / "cache")), printed
    assert (pathlib.Path(printed[0]) / "optax" / "__init__.pyi").read_bytes() == (
        stubs / "mypy" / "optax" / "__init__.pyi").read_bytes()
    # The installed stubs are the checkout's byte for byte; the docs' commands run on the wheel.
    installed = _site_packages(venv) / "eqx_offload" / ".typings"
    assert {p.relative_to(installed): p.read_bytes() for p in installed.rglob("*.pyi")} == {
        p.relative_to(stubs): p.read_bytes() for p in stubs.rglob("*.pyi")}

    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(GOOD, project / "train.py")
    shutil.copy(TYPES / "bad_narrowing.py", project / "bad_narrowing.py")
    expected = TABLE.expected_errors(TYPES / "bad_narrowing.py")

    def run(command: str, file: str) -> str:
        proc = subprocess.run(["bash", "-c", command.replace("train.py", file)],
                              capture_output=True, text=True, env=env, cwd=project, timeout=600)
        return TABLE._ANSI.sub("", proc.stdout + proc.stderr)

    mypy = _docs_block("mypy --strict").strip().splitlines()[-1]
    pytype = _docs_block("pytype-single --pythonpath=$(python -m eqx_offload typings) train.py")
    for checker, command, error in [("mypy", mypy, ": error: .*"), ("pytype", pytype, r":\d+: .*")]:
        if checker == "mypy" or TABLE.PYTYPE_RUNS:
            output = run(command.strip().splitlines()[-1], "bad_narrowing.py")
            found = re.finditer(rf"bad_narrowing.py:(\d+){error}\[([a-z-]+)\]", output)
            assert {(int(m[1]), m[2]) for m in found} == expected[checker], checker
    # pyright and pyrefly need no stub, and the one in site-packages does not bother them.
    assert "0 errors" in run("pyright train.py", "train.py")
    (project / "pyrefly.toml").write_text("")
    assert "INFO 0 errors" in run("pyrefly check train.py", "train.py")


TWO_MODULES = {
    "__init__.py": "",
    "model.py": textwrap.dedent('''\
        import optax

        import eqx_offload


        def make_optimizer(learning_rate: float) -> optax.GradientTransformationExtraArgs:
            return eqx_offload.offloaded(optax.adam(learning_rate))
        '''),
    "train.py": textwrap.dedent('''\
        import jax.numpy as jnp

        import eqx_offload
        from my_project.model import make_optimizer

        params = {"w": jnp.ones(3)}
        opt = make_optimizer("fast")  # a str where model.py wants a float
        state = opt.init(params)
        assert isinstance(state, eqx_offload.OffloadedState)
        eqx_offload.to_device(state, memory_kind="device")
        '''),
}


@pytest.mark.slow
@needs_pytype
@once
def test_documented_pytype_loop_checks_across_modules(tmp_path: pathlib.Path) -> None:
    (tmp_path / "my_project").mkdir()
    for name, text in TWO_MODULES.items():
        (tmp_path / "my_project" / name).write_text(text)
    loop = _docs_block("for pass in 1 2")
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", loop], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=600)
    output = TABLE._ANSI.sub("", proc.stdout + proc.stderr)
    assert proc.returncode == 1, output
    errors = sorted(re.findall(r"^(my_project/\w+\.py):(\d+):\d+: .*\[([a-z-]+)\]$", output, re.M))
    assert errors == [("my_project/train.py", "10", "wrong-keyword-args"),
                      ("my_project/train.py", "7", "wrong-arg-types")], output
    assert "pkg.model.make_optimizer" not in output and "my_project.model.make_optimizer" in output

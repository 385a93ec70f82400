"""Where the `.pyi` stubs shipped with the package are, for the static checkers that need
them (`python -m eqx_offload typings [--mypy]` prints these paths).

In the repository the stubs live in the top-level `typings/`; the wheel ships them as
`eqx_offload/.typings/` (a path mapping in pyproject.toml), a hidden folder, which
pyright, pyrefly and mypy skip when they collect files, so the pytype stubs of jax and
equinox never stand in for the real packages, nor get checked against them.

- `pytype/`: jax, equinox, jaxtyping and eqx_offload, for pytype, which otherwise reads
  these packages as `Any`.
- `mypy/`: optax only, which ships no `py.typed`. mypy, pyright and pyrefly read the
  inline types of jax, equinox, jaxtyping and eqx_offload; pytype reads this folder too.
"""

import hashlib
import importlib.metadata
import os
import pathlib
import shutil
import tempfile


_PACKAGE = pathlib.Path(__file__).resolve().parent
# An installed wheel: the mapped folder inside the package; a source checkout (an
# editable install included): the repository's `typings/`.
_ROOT = _PACKAGE / ".typings" if (_PACKAGE / ".typings").is_dir() else _PACKAGE.parent / "typings"


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "eqx_offload"


def _outside_site_packages(folder: pathlib.Path) -> pathlib.Path:
    """`folder` itself, or where it is installed (under `site-packages`) a copy of it in
    the user's cache folder, named by the package version and the stubs' content.

    mypy refuses a `mypy_path` inside site-packages ("... is in the MYPYPATH. Please
    remove it."), so a wheel cannot hand it the stub where it lies."""
    if not {"site-packages", "dist-packages"} & set(folder.parts):
        return folder
    files = sorted(p for p in folder.rglob("*.pyi"))
    digest = hashlib.sha256()
    for p in files:
        digest.update(str(p.relative_to(folder)).encode() + b"\0" + p.read_bytes())
    version = importlib.metadata.version("eqx_offload")
    target = _cache_dir() / f"typings-{version}-{digest.hexdigest()[:12]}" / folder.name
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Copied next to the target and renamed into place: two processes asking at
        # once both end up with a complete folder.
        staging = pathlib.Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
        shutil.copytree(folder, staging / folder.name)
        try:
            os.rename(staging / folder.name, target)
        except OSError:
            if not target.is_dir():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def mypy_path() -> str:
    """The folder to put on mypy's `mypy_path`: the optax stub, and nothing else.

    Where the package is installed in site-packages this is a copy of the shipped stub in
    the user's cache folder (`$XDG_CACHE_HOME/eqx_offload/`, by default
    `~/.cache/eqx_offload/`), one per version of the stubs, since mypy refuses a
    `mypy_path` inside site-packages; in a source checkout it is the stub itself.

    **Returns:**

    An absolute path (a folder that holds `optax/__init__.pyi`).
    """
    return str(_outside_site_packages(_ROOT / "mypy"))


def pytype_path() -> str:
    """The value for pytype's `--pythonpath`: the stubs of jax, equinox, jaxtyping, optax
    and eqx_offload.

    **Returns:**

    Two absolute folders joined by `os.pathsep` (`:` on Linux and macOS), the pytype
    stubs first, then the optax stub that mypy reads too (both where the package is
    installed: pytype, unlike mypy, reads them there).
    """
    return os.pathsep.join([str(_ROOT / "pytype"), str(_ROOT / "mypy")])

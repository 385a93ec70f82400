"""Runtime type checks for eqx_offload and the user's own modules.

`install_runtime_checks("my_training")` installs jaxtyping's own import hook with
beartype (`jaxtyping.install_import_hook(modules, "beartype.beartype")`) for the named
modules, and applies the same check (`@jaxtyped(typechecker=beartype)`) to the public
functions of eqx_offload, whose failures are cut to the first lines of jaxtyping's
message (the function, the argument, the value, the expected type), with the whole
message kept on the error as `.full_message`. beartype is imported when a check is first
applied, so `import eqx_offload` does not load it.
"""

import functools
import inspect
import sys
import typing
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jaxtyping

from ._core.errors import OptionError


_F = TypeVar("_F", bound=Callable[..., Any])
_PACKAGE = __name__.rpartition(".")[0]  # "eqx_offload"
_HOOKED: set[str] = set()  # the module names given to jaxtyping's import hook so far
_LINES, _WIDTH = 4, 160  # what a short error keeps of jaxtyping's message
_DOCS = "docs/typing.md, Runtime checks"


def _short(message: str) -> str:
    lines = [line if len(line) <= _WIDTH else line[: _WIDTH - 1] + "…"
             for line in message.strip().splitlines()[:_LINES]]
    return "\n".join([*lines, f"(the whole message: the error's `.full_message`; {_DOCS})"])


def checked(fn: _F) -> _F:
    """`@jaxtyped(typechecker=beartype)` with short errors: what `install_runtime_checks`
    applies to eqx_offload's public functions.

    **Arguments:**

    - `fn`: a function.

    **Returns:**

    The function, checked at each call: a wrong argument or result raises a
    `jaxtyping.TypeCheckError` holding the first lines of jaxtyping's message;
    `.full_message` holds all of it.
    """
    from beartype import beartype  # here: `import eqx_offload` does not load beartype

    inner = jaxtyping.jaxtyped(typechecker=beartype)(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            return inner(*args, **kwargs)
        except jaxtyping.TypeCheckError as error:
            if hasattr(error, "full_message"):  # already short: a checked function inside
                raise
            short = jaxtyping.TypeCheckError(_short(str(error)))
            short.full_message = str(error)  # type: ignore[attr-defined]  # jaxtyping's message, kept for debugging
            raise short from None

    return typing.cast(_F, wrapper)


def _check_eqx_offload() -> None:
    """Checks on the public functions (and dataclasses' constructors) of eqx_offload and
    its public submodules, which are already imported when `install_runtime_checks` runs."""
    package = sys.modules[_PACKAGE]
    if getattr(package, "__runtime_checks__", False):
        return
    public = [package] + [m for name, m in vars(package).items() if inspect.ismodule(m)
                          and m.__name__ == f"{_PACKAGE}.{name}" and name[0] != "_" and name != "cli"]
    classes = set()
    for module in public:
        for name, value in list(vars(module).items()):
            if name.startswith("_") or name == "install_runtime_checks":
                continue
            if inspect.isfunction(value) and value.__module__.startswith(_PACKAGE + "."):
                setattr(module, name, checked(value))
            elif inspect.isclass(value) and "__dataclass_fields__" in vars(value):
                classes.add(value)
    for cls in classes:  # (each once, however many modules export it)
        cls.__init__ = checked(cls.__init__)  # type: ignore[method-assign]  # checks the dataclasses' constructors in place
    package.__runtime_checks__ = True  # type: ignore[attr-defined]  # marks the package as done


def _covered(module: str, names: Iterable[str]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def install_runtime_checks(*modules: str) -> None:
    """Type-checks eqx_offload's public functions and every function of `modules` at
    run time, with jaxtyping's import hook and beartype.

    Call it in your entry point before importing your own modules:

    ```py
    import eqx_offload
    eqx_offload.install_runtime_checks("my_training")
    import my_training  # every function of my_training and its submodules is checked
    ```

    A wrong argument then raises a `jaxtyping.TypeCheckError` (a `TypeError`):
    jaxtyping's own message for your functions (shapes too: `Float[Array, "n 1"]`
    against the other arguments of the call), its first lines for eqx_offload's.
    Under `jax.jit` the checks run while tracing only; compiled calls pay nothing.

    **Arguments:**

    - `modules`: names of your packages or modules (`"my_training"` covers
        `my_training.data` too). Not yet imported: a module imported before the call
        keeps its functions unchecked.

    **Returns:**

    Nothing. Calling it again adds modules; there is no uninstall.

    **Raises:**

    `OptionError` (a `ValueError` and `TypeError`) if a module is already imported or a
    name is not a string.
    """
    for name in modules:
        if not isinstance(name, str) or not name:
            raise OptionError(f"install_runtime_checks: module names are strings, got {name!r}")
    already = sorted(m for m in sys.modules if _covered(m, modules) and not _covered(m, _HOOKED))
    if already:
        raise OptionError(
            f"install_runtime_checks: {', '.join(already)} is already imported, so its "
            "functions would stay unchecked. Call install_runtime_checks first and import "
            "your modules after it (the script you run as `python script.py` is never "
            "checked: keep the code in a module that it imports)."
        )
    _check_eqx_offload()
    new = [m for m in modules if not _covered(m, _HOOKED)]
    if new:
        jaxtyping.install_import_hook(new, "beartype.beartype")
        _HOOKED.update(new)

"""Runtime type checks for eqx_offload and the user's own modules, with short errors.

`install_runtime_checks("my_training")` does what jaxtyping's import hook with beartype
does (`@jaxtyped(typechecker=beartype)` on every function of the named modules, when they
are imported), and applies the same checks to the public functions of eqx_offload. The
difference is the error: jaxtyping prints every argument of the call as a pytree and the
whole annotation (a `Where` unrolled is a page), 80 to 190 lines; here a failed check
raises a `jaxtyping.TypeCheckError` of a few lines that names the function, the argument,
what was expected, what was given, the axis sizes bound so far and a fix. The full
message stays on the error as `.full_message`.

Why not `jaxtyping.install_import_hook(modules, "beartype.beartype")` underneath: its
hook adds `@jaxtyped(typechecker=...)` as the function's own wrapper, and `jaxtyped`
turns every failure of the typechecker into its long `TypeCheckError` inside that
wrapper (with the arguments as pytrees); a short error needs code around that wrapper,
where the hook gives no place (only an `AnnotationError` passes through it unchanged,
and jaxtyping's axis sizes are private there). So the finder below adds `checked`
instead, the same transformation as jaxtyping's (a decorator on every function, not
under `@no_type_check`). beartype is imported when a check is first applied, so
`import eqx_offload` does not load it.
"""

import ast
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Optional, TypeVar

import jax
import jaxtyping

from ._errors import OptionError


_F = TypeVar("_F", bound=Callable[..., Any])
_PACKAGE = __name__.rpartition(".")[0]  # "eqx_offload"

_DECORATOR = "checked"
_PARAM = re.compile(r"The problem arose whilst typechecking parameter '(?P<name>[^']+)'")
_AXES = "The current values for each jaxtyping axis annotation are as follows."

# How to fix a wrong argument of eqx_offload's public functions, by parameter name.
_FIXES = {
    "inner": "pass a transformation, e.g. `optax.adam(1e-3)` (the factory called), not "
             "the factory itself or a model",
    "memory_kind": "use 'pinned_host' or 'unpinned_host' (what the device offers: "
                   "`eqx_offload.supported_memory_kinds()`); `to_device` takes none",
    "where": "use True/False, a function of a leaf, `eqx_offload.pattern(regex)`, "
             "`min_bytes(n)`, `min_ndim(n)`, or a prefix tree (dict/list/tuple) of those",
    "donate": "use one of 'all', 'all-except-first', 'warn', 'warn-except-first', 'none'",
    "compute": "use 'device' or 'host'",
    "group_bytes": "give a number of bytes as an int, e.g. `64 << 20`",
    "device": "pass a `jax.Device` (e.g. `jax.devices()[0]`), not a platform name",
    "state": "pass the state that `init` returned (or the previous `update` returned)",
    "regex": "pass a regular expression string, e.g. `eqx_offload.pattern(r'.*/mu/.*')`",
    "nbytes": "give a number of bytes as an int, e.g. `eqx_offload.min_bytes(1 << 20)`",
    "ndim": "give a number of dimensions as an int, e.g. `eqx_offload.min_ndim(1)`",
}
# `optax._src.base.GradientTransformation` -> `optax.GradientTransformation`.
_PRIVATE_PATH = re.compile(r"\b([A-Za-z]\w*)(?:\.\w+)*?\._\w+(?:\.\w+)*?\.([A-Z]\w*)")
_TYPING_PREFIX = re.compile(r"\b(?:typing|collections\.abc|builtins)\.")


def _short(text: str, limit: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _describe_value(value: Any) -> str:
    """A one-line description of `value`: arrays by dtype and shape, functions by name,
    containers by their keys or length, never a whole pytree."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:
        kind = "jax.Array" if isinstance(value, jax.Array) else type(value).__qualname__
        return f"{kind} {getattr(dtype, 'name', dtype)}{list(shape)}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, functools.partial)):
        return f"the function {getattr(value, '__qualname__', repr(value))}"
    if isinstance(value, type):
        return f"the class {value.__qualname__}"
    if isinstance(value, dict):
        return f"a dict with keys {_short(repr(list(value)), 60)}"
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return f"a {type(value).__name__} of {len(value)} item{'s' * (len(value) != 1)}"
    if isinstance(value, (str, bytes, int, float, complex, bool)) or value is None:
        return _short(repr(value), 60)
    return f"a {type(value).__qualname__}"


def _describe_type(annotation: Any) -> str:
    """The annotation as its alias name where it has one (`Where`, `MemoryKind`, ...),
    otherwise as written, cut to one line."""
    from . import _types

    for name in ("Where", "MemoryKind", "HostMemoryKind", "Donate"):
        if annotation is getattr(_types, name, None):
            return name + (f" (one of {', '.join(map(repr, typing.get_args(annotation)))})"
                           if typing.get_origin(annotation) is typing.Literal else "")
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(annotation)))
    if isinstance(annotation, type):
        text = f"{annotation.__module__}.{annotation.__qualname__}"
    else:
        text = repr(annotation)
    text = _TYPING_PREFIX.sub("", text)
    text = _PRIVATE_PATH.sub(r"\1.\2", text).replace("jaxlib.Array", "jax.Array")
    # jaxtyping writes the array type as JAX names it: `jaxlib._jax.Array` (JAX 0.10),
    # `Array` (0.12); one spelling on every version.
    text = re.sub(r"\[Array\b", "[jax.Array", text)
    union = re.fullmatch(r"(Union|Optional)\[([^\[\]]*)\]", text)
    if union is not None:
        parts = [part.strip() for part in union[2].split(",")]
        text = " | ".join(parts + (["None"] if union[1] == "Optional" else []))
    return _short(text, 120)


def _axes(message: str) -> str:
    if _AXES not in message:
        return ""
    sizes = [line.strip() for line in message.split(_AXES, 1)[1].splitlines() if "=" in line]
    return ", ".join(sizes)


def _fix(fn: Callable[..., Any], parameter: Optional[str], annotation: Any, axes: str) -> str:
    if parameter is not None and parameter in _FIXES and fn.__module__.startswith(_PACKAGE + "."):
        return _FIXES[parameter]
    if axes:
        return ("make the shapes agree with the annotation: an axis name stands for one "
                "size across all the arguments (and the result) of one call")
    if typing.get_origin(annotation) is typing.Literal:
        return "use one of the values listed"
    return "pass a value of the expected type, or correct the annotation if the value is right"


def _public_name(fn: Callable[..., Any]) -> str:
    """`eqx_offload.offloaded` for `eqx_offload._optax.offloaded`, `eqx_offload.pattern`
    for its `__init__`; other functions by module and qualified name."""
    qualname = fn.__qualname__.removesuffix(".__init__")
    package = sys.modules.get(_PACKAGE)
    if fn.__module__.startswith(_PACKAGE + ".") and hasattr(package, qualname.split(".")[0]):
        return f"{_PACKAGE}.{qualname}"
    return f"{fn.__module__}.{qualname}"


def _short_error(
    fn: Callable[..., Any], error: jaxtyping.TypeCheckError, args: Any, kwargs: Any
) -> Optional[str]:
    """A short message for `error` if it is about the arguments or the result of `fn`
    itself (and not of a checked function that `fn` called), else None."""
    message = str(error)
    name = f"{fn.__module__}.{fn.__qualname__}"  # as jaxtyping names it
    shown = _public_name(fn)
    signature = inspect.signature(fn)
    axes = _axes(message)
    if message.startswith(f"Type-check error whilst checking the parameters of {name}."):
        match = _PARAM.search(message)
        if match is None:  # no single argument is wrong: they disagree (axis sizes)
            lines = [f"{shown}(): the arguments do not agree with each other's annotations."]
            parameter, annotation = None, None
        else:
            parameter = match["name"]
            annotation = signature.parameters[parameter].annotation
            try:
                bound = signature.bind(*args, **kwargs)
                given = _describe_value(bound.arguments[parameter])
            except (TypeError, KeyError):
                given = "(could not be read back)"
            lines = [
                f"{shown}(): argument `{parameter}` has the wrong type.",
                f"  expected: {_describe_type(annotation)}",
                f"  given:    {given}",
            ]
    elif message.startswith(f"Type-check error whilst checking the return value of {name}."):
        parameter, annotation = None, signature.return_annotation
        actual = message.split("Actual value: ", 1)[1].split("\n", 1)[0] if "Actual value: " in message else "?"
        lines = [
            f"{shown}(): the return value has the wrong type.",
            f"  expected: {_describe_type(annotation)}",
            f"  returned: {_short(actual, 100)}",
        ]
    else:
        return None
    if axes:
        lines.append(f"  axis sizes bound in this call: {axes}")
    lines.append(f"  fix: {_fix(fn, parameter, annotation, axes)}")
    return "\n".join(lines)


def checked(fn: _F) -> _F:
    """`@jaxtyped(typechecker=beartype)` with short errors: what
    `install_runtime_checks` applies to every function of the named modules.

    **Arguments:**

    - `fn`: a function.

    **Returns:**

    The function, checked at each call: a wrong argument or result raises a
    `jaxtyping.TypeCheckError` of a few lines; `.full_message` holds jaxtyping's own.
    """
    from beartype import beartype  # here: `import eqx_offload` does not load beartype

    inner = jaxtyping.jaxtyped(typechecker=beartype)(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            return inner(*args, **kwargs)
        except jaxtyping.TypeCheckError as error:
            short = _short_error(fn, error, args, kwargs)
            if short is None:
                raise
            replacement = jaxtyping.TypeCheckError(short)
            replacement.full_message = str(error)  # type: ignore[attr-defined]  # jaxtyping's message, kept for debugging
            raise replacement from None

    return typing.cast(_F, wrapper)


class _Instrument(ast.NodeTransformer):
    """Adds `@eqx_offload._runtime.checked` as the innermost decorator of every function
    (where jaxtyping's hook puts `@jaxtyped`), except under `@no_type_check`."""

    def visit_Module(self, node: ast.Module) -> ast.Module:
        node.body.insert(_after_docstring_and_future(node), ast.parse(
            "import eqx_offload._runtime as __eqx_offload_runtime__").body[0])
        self.generic_visit(node)
        return node

    def _function(self, node: Any) -> Any:
        if not any("no_type_check" in ast.unparse(d) for d in node.decorator_list):
            node.decorator_list.append(ast.parse(f"__eqx_offload_runtime__.{_DECORATOR}",
                                                 mode="eval").body)
            self.generic_visit(node)
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> Any:
        return self._function(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> Any:
        return self._function(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> Any:
        if not any("no_type_check" in ast.unparse(d) for d in node.decorator_list):
            self.generic_visit(node)
        return node


def _after_docstring_and_future(node: ast.Module) -> int:
    for i, child in enumerate(node.body):
        docstring = i == 0 and isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant)
        future = isinstance(child, ast.ImportFrom) and child.module == "__future__"
        if not (docstring or future):
            return i
    return len(node.body)


class _Loader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname: str) -> types.CodeType:
        # Always from source: a cached .pyc is the module without the checks.
        return self.source_to_code(self.get_data(self.path), self.path)

    def source_to_code(  # type: ignore[override]  # typeshed's signature is the stdlib's private one
        self, data: Any, path: Any, *, _optimize: int = -1
    ) -> types.CodeType:
        tree = ast.parse(importlib.util.decode_source(data), path)
        tree = ast.fix_missing_locations(_Instrument().visit(tree))
        return compile(tree, path, "exec", dont_inherit=True, optimize=_optimize)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.prefixes: set[str] = set()

    def covers(self, fullname: str) -> bool:
        return any(fullname == p or fullname.startswith(p + ".") for p in self.prefixes)

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[types.ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if not self.covers(fullname):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader = _Loader(spec.loader.name, spec.loader.path)
            return spec
        return None


_FINDER = _Finder()


def _check_eqx_offload() -> None:
    """Checks on the public functions (and filter classes) of eqx_offload, which is
    already imported when `install_runtime_checks` runs."""
    package = sys.modules[_PACKAGE]
    if getattr(package, "__runtime_checks__", False):
        return
    for name, value in vars(package).items():
        if name.startswith("_") or name == "install_runtime_checks":
            continue
        if inspect.isfunction(value) and value.__module__.startswith(_PACKAGE + "."):
            setattr(package, name, checked(value))
        elif inspect.isclass(value) and "__dataclass_fields__" in vars(value):
            value.__init__ = checked(value.__init__)  # type: ignore[method-assign]  # checks the filter dataclasses' constructors in place
    package.__runtime_checks__ = True  # type: ignore[attr-defined]  # marks the package as done


def install_runtime_checks(*modules: str) -> None:
    """Type-checks eqx_offload's public functions and every function of `modules` at
    run time (jaxtyping + beartype, as jaxtyping's import hook does), with short errors.

    Call it in your entry point before importing your own modules:

    ```py
    import eqx_offload
    eqx_offload.install_runtime_checks("my_training")
    import my_training  # every function of my_training and its submodules is checked
    ```

    A wrong argument then raises a `jaxtyping.TypeCheckError` (a `TypeError`) of a few
    lines: the function, the argument, what was expected, what was given, the axis
    sizes bound so far for `Float[Array, "n 1"]`-style annotations, and a fix.
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
    already = sorted(m for m in sys.modules if any(m == n or m.startswith(n + ".")
                                                   for n in modules) and not _FINDER.covers(m))
    if already:
        raise OptionError(
            f"install_runtime_checks: {', '.join(already)} is already imported, so its "
            "functions would stay unchecked. Call install_runtime_checks first and import "
            "your modules after it (the script you run as `python script.py` is never "
            "checked: keep the code in a module that it imports)."
        )
    _check_eqx_offload()
    _FINDER.prefixes.update(modules)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)

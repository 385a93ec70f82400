"""Canary: CPython replaces an `AttributeError` that a module's `__getattr__` raises
during `from module import name` by its bare "cannot import name", and the importing
frame's instruction then is `IMPORT_FROM` (`compat.caller_imports_from`, which
`eqx_offload.__getattr__` reads to raise its message as an `ImportError`). If CPython
keeps the message, or names the instruction otherwise, this fails first."""

import sys
import types

import pytest

from eqx_offload._core.compat import caller_imports_from


def _passed(frame: types.FrameType) -> bool:
    """The module's `__getattr__` and the runtime checker's wrappers (the test run's
    jaxtyping hook wraps the package's functions): not the importer."""
    return (frame.f_code.co_name == "__getattr__"
            or frame.f_globals.get("__name__", "").startswith(("beartype", "jaxtyping"))
            or frame.f_code.co_filename.startswith("<@beartype"))


def _module(seen: list[bool]) -> types.ModuleType:
    module = types.ModuleType("eqx_offload_canary_module")

    def __getattr__(name: str) -> object:
        seen.append(caller_imports_from(_passed))
        raise AttributeError(f"the message for {name}")

    module.__getattr__ = __getattr__  # type: ignore[method-assign]  # (a module's hook)
    return module


def test_from_import_loses_the_attribute_error_and_is_seen() -> None:
    seen: list[bool] = []
    sys.modules["eqx_offload_canary_module"] = _module(seen)
    try:
        with pytest.raises(ImportError) as caught:
            from eqx_offload_canary_module import moved  # noqa: F401
        assert "the message for moved" not in str(caught.value)
        assert "cannot import name" in str(caught.value)
        with pytest.raises(AttributeError, match="the message for moved"):
            getattr(sys.modules["eqx_offload_canary_module"], "moved")
    finally:
        del sys.modules["eqx_offload_canary_module"]
    # The import asks `__getattr__` for `__path__` first (`IMPORT_NAME`), then for the
    # name (`IMPORT_FROM`); `getattr` is no import.
    assert seen == [False, True, False], seen

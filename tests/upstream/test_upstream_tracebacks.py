"""Canary: JAX leaves the frames of a registered folder out of the tracebacks it filters
(`jax._src.traceback_util.register_exclusion`), below a filtering boundary
(`traceback_util.api_boundary`), as Equinox relies on for its own files. `compat.hide_frames`
registers this package's folder and `compat.boundary` makes `offloaded`'s `init` and
`update` boundaries; without them a user's error shows the library's frames again."""

import importlib.util
import pathlib
import traceback

import jax
import pytest

from eqx_offload._core.compat import boundary, hide_frames


def _files(error: BaseException) -> list[str]:
    return [frame.f_code.co_filename for frame, _ in traceback.walk_tb(error.__traceback__)]


def test_a_registered_folder_leaves_the_filtered_traceback(tmp_path: pathlib.Path) -> None:
    library = tmp_path / "hidden" / "library.py"
    library.parent.mkdir()
    library.write_text("def fail():\n    raise ValueError('the message')\n")
    spec = importlib.util.spec_from_file_location("hidden_library", library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def call() -> None:
        module.fail()

    previous = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "quiet_remove_frames")
    try:
        with pytest.raises(ValueError, match="the message") as unfiltered:
            boundary(call)()
        assert str(library) in _files(unfiltered.value)  # not registered: shown
        hide_frames(str(library.parent))
        with pytest.raises(ValueError, match="the message") as filtered:
            boundary(call)()
    finally:
        jax.config.update("jax_traceback_filtering", previous)
    files = _files(filtered.value)
    assert str(library) not in files
    assert __file__ in files  # the caller's frame stays

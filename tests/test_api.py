"""The public API's shape: a small top level, the rest in the documented submodules, and
an old top-level name answered with its new place."""

import importlib
import pathlib

import pytest

import eqx_offload


SUBMODULES = ("checkpoint", "errors", "memory", "planner", "remat", "stream", "types")


def test_the_top_level_is_small_and_every_submodule_is_documented() -> None:
    assert len(eqx_offload.__all__) <= 25
    text = (pathlib.Path(__file__).parents[1] / "docs" / "api" / "index.md").read_text()
    for name in SUBMODULES:
        module = getattr(eqx_offload, name)
        assert module is importlib.import_module(f"eqx_offload.{name}")
        assert module.__all__ and all(hasattr(module, n) for n in module.__all__), name
        assert f"`eqx_offload.{name}`" in text, name
    for name in eqx_offload.__all__:
        assert f"`{name}`" in text, name


@pytest.mark.parametrize("old,new", [
    ("stream_plan", "eqx_offload.stream.stream_plan"),
    ("OptionError", "eqx_offload.errors.OptionError"),
    ("GPU_TARGETS", "eqx_offload.planner.GPU_TARGETS"),
    ("gpu_plan", "eqx_offload.planner.gpu_plan"),
    ("host_params", "eqx_offload.host_weights_optimizer"),
    ("restore_target", "eqx_offload.checkpoint.restore_target"),
])
def test_an_old_name_says_where_it_went(old: str, new: str) -> None:
    with pytest.raises(AttributeError, match=f"Use {new}: eqx_offload.{old} moved there"):
        getattr(eqx_offload, old)
    assert not hasattr(eqx_offload, "no_such_name") and not hasattr(eqx_offload, old)
    # `from eqx_offload import old`: Python would replace the AttributeError by its bare
    # "cannot import name"; the message comes through as an ImportError.
    with pytest.raises(ImportError, match=f"^Use {new}: eqx_offload.{old} moved there"):
        exec(f"from eqx_offload import {old}", {})  # noqa: S102 (the statement itself)

"""The package's ambient channels (`contextvars.ContextVar`): at most two, each one
docs/architecture.md names with its reason; everything else reaches a function through
its arguments."""

import pathlib
import re

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]
# Each `ContextVar` of the package, by module, and the name docs/architecture.md gives it.
CHANNELS = {
    "_jit/stage.py": "The program being traced",
    "_stream/backward.py": "The backward pass's hook",
}


def _context_vars(package: pathlib.Path) -> dict[str, int]:
    found = {}
    for path in sorted(package.rglob("*.py")):
        count = len(re.findall(r"ContextVar\(", path.read_text()))
        if count:
            found[path.relative_to(package).as_posix()] = count
    return found


@pytest.mark.once
def test_at_most_two_context_vars_each_named_with_its_reason() -> None:
    found = _context_vars(ROOT / "eqx_offload")
    assert sum(found.values()) <= 2 and len(CHANNELS) <= 2
    assert found == dict.fromkeys(CHANNELS, 1)
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Channels a signature does not show")[1].split("\n## ")[0]
    for module, name in CHANNELS.items():
        entry = section.split(f"**{name}**", 1)
        assert len(entry) == 2, name
        assert f"(`{module.removesuffix('.py')}" in entry[1].split("\n- **")[0], module


@pytest.mark.once
def test_the_count_fails_on_a_third(tmp_path: pathlib.Path) -> None:
    """The count sees a `ContextVar` added anywhere in the package."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text('x = contextvars.ContextVar("a")\n')
    (tmp_path / "sub" / "b.py").write_text('y = contextvars.ContextVar("b")\n'
                                          'z = contextvars.ContextVar("c")\n')
    assert _context_vars(tmp_path) == {"a.py": 1, "sub/b.py": 2}

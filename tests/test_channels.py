"""The package's ambient channels (`contextvars.ContextVar`) are the ones
docs/architecture.md names, each with its reason: everything else reaches a function
through its arguments (an option of `offloaded` or of the 8-bit packing among them)."""

import pathlib
import re

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]
# Each `ContextVar` of the package, by module, and the name docs/architecture.md gives it.
CHANNELS = {
    "_core/target.py": "The lowering platforms",
    "_jit/lint.py": "The foreign-donation switch",
    "_stream/backward.py": "The backward pass's hook",
    "_models/make.py": "The layer being made",
}


@pytest.mark.once
def test_every_context_var_is_named_with_its_reason() -> None:
    found = {}
    for path in sorted((ROOT / "eqx_offload").rglob("*.py")):
        count = len(re.findall(r"ContextVar\(", path.read_text()))
        if count:
            found[path.relative_to(ROOT / "eqx_offload").as_posix()] = count
    assert found == dict.fromkeys(CHANNELS, 1)
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Channels a signature does not show")[1].split("\n## ")[0]
    for module, name in CHANNELS.items():
        assert f"**{name}**" in section, name
        assert f"`{module.removesuffix('.py')}" in section or module.split("/")[-1].removesuffix(
            ".py") in section, module

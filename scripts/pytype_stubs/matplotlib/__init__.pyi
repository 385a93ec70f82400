# matplotlib (the `bench` extra) is not checked: every name is `Any`, declared here so
# pytype does not report the optional import as missing.
from typing import Any

def __getattr__(name: str) -> Any: ...

from typing import Any, Optional

class Group:
    def __init__(self, *renderables: Any, fit: bool = True) -> None: ...

class Console:
    width: int
    def __init__(
        self,
        *,
        width: Optional[int] = None,
        record: bool = False,
        file: Optional[Any] = None,
        force_terminal: Optional[bool] = None,
        color_system: Optional[str] = ...,
        highlight: bool = True,
        soft_wrap: bool = False,
        **kwargs: Any,
    ) -> None: ...
    def print(self, *objects: Any, sep: str = " ", end: str = "\n", style: Any = None, **kwargs: Any) -> None: ...
    def log(self, *objects: Any, **kwargs: Any) -> None: ...
    def rule(self, title: Any = "", **kwargs: Any) -> None: ...
    def export_text(self, *, clear: bool = True, styles: bool = False) -> str: ...

def __getattr__(name: str) -> Any: ...

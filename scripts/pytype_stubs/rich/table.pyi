from typing import Any, Optional

class Table:
    def __init__(
        self,
        *headers: Any,
        title: Optional[Any] = None,
        caption: Optional[Any] = None,
        show_header: bool = True,
        show_footer: bool = False,
        show_lines: bool = False,
        box: Any = ...,
        expand: bool = False,
        **kwargs: Any,
    ) -> None: ...
    def add_column(
        self,
        header: Any = "",
        footer: Any = "",
        *,
        justify: str = "left",
        style: Optional[Any] = None,
        no_wrap: bool = False,
        **kwargs: Any,
    ) -> None: ...
    def add_row(self, *renderables: Optional[Any], style: Optional[Any] = None, end_section: bool = False) -> None: ...
    def add_section(self) -> None: ...

def __getattr__(name: str) -> Any: ...

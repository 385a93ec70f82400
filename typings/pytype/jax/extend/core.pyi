from typing import Any

class Literal:
    val: Any
    aval: Any

class Var:
    aval: Any

class Primitive:
    name: str
    def bind(self, *args: Any, **params: Any) -> Any: ...

class Jaxpr:
    @property
    def invars(self) -> list[Var]: ...
    @property
    def outvars(self) -> list[Any]: ...
    @property
    def constvars(self) -> list[Var]: ...
    @property
    def eqns(self) -> list[Any]: ...

class ClosedJaxpr:
    @property
    def jaxpr(self) -> Jaxpr: ...
    @property
    def consts(self) -> list[Any]: ...
    @property
    def in_avals(self) -> list[Any]: ...
    @property
    def out_avals(self) -> list[Any]: ...

def __getattr__(name: str) -> Any: ...

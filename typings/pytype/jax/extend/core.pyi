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
    invars: list[Var]
    outvars: list[Any]
    constvars: list[Var]
    eqns: list[Any]

class ClosedJaxpr:
    jaxpr: Jaxpr
    consts: list[Any]
    in_avals: list[Any]
    out_avals: list[Any]

def __getattr__(name: str) -> Any: ...

# The common layers of `equinox.nn`; every other name is `Any`.
from collections.abc import Callable, Sequence
from typing import Any, Literal, Optional, Union

from jax import Array

from equinox import Module

class Linear(Module):
    weight: Array
    bias: Optional[Array]
    in_features: Union[int, Literal["scalar"]]
    out_features: Union[int, Literal["scalar"]]
    use_bias: bool
    def __init__(
        self,
        in_features: Union[int, Literal["scalar"]],
        out_features: Union[int, Literal["scalar"]],
        use_bias: bool = True,
        dtype: Any = None,
        *,
        key: Array,
    ) -> None: ...
    def __call__(self, x: Array, *, key: Optional[Array] = None) -> Array: ...

class MLP(Module):
    layers: tuple[Linear, ...]
    in_size: Union[int, Literal["scalar"]]
    out_size: Union[int, Literal["scalar"]]
    width_size: int
    depth: int
    def __init__(
        self,
        in_size: Union[int, Literal["scalar"]],
        out_size: Union[int, Literal["scalar"]],
        width_size: int,
        depth: int,
        activation: Callable[..., Any] = ...,
        final_activation: Callable[..., Any] = ...,
        use_bias: bool = True,
        use_final_bias: bool = True,
        dtype: Any = None,
        *,
        scan: bool = False,
        key: Array,
    ) -> None: ...
    def __call__(self, x: Array, *, key: Optional[Array] = None) -> Array: ...

class LayerNorm(Module):
    def __init__(
        self,
        shape: Union[int, Sequence[int]],
        eps: float = 1e-05,
        use_weight: bool = True,
        use_bias: bool = True,
        dtype: Any = None,
    ) -> None: ...
    def __call__(self, x: Array, state: Any = ..., *, key: Optional[Array] = None) -> Array: ...

class Dropout(Module):
    def __init__(self, p: float = 0.5, inference: bool = False) -> None: ...
    def __call__(self, x: Array, *, key: Optional[Array] = None, inference: Optional[bool] = None) -> Array: ...

class Lambda(Module):
    def __init__(self, fn: Callable[[Any], Any]) -> None: ...
    def __call__(self, x: Any, *, key: Optional[Array] = None) -> Any: ...

class Sequential(Module):
    layers: tuple[Callable[..., Any], ...]
    def __init__(self, layers: Sequence[Callable[..., Any]]) -> None: ...
    def __call__(self, x: Any, state: Any = ..., *, key: Optional[Array] = None) -> Any: ...

class Embedding(Module):
    def __init__(
        self,
        num_embeddings: Optional[int] = None,
        embedding_size: Optional[int] = None,
        weight: Optional[Array] = None,
        dtype: Any = None,
        *,
        key: Optional[Array] = None,
    ) -> None: ...
    def __call__(self, x: Array, *, key: Optional[Array] = None) -> Array: ...

def __getattr__(name: str) -> Any: ...

"""`jit`: `jax.jit`'s interface (argument numbers and names) on `filter_jit`'s
machinery (input and output shardings with memory kinds), for programs written for
`jax.jit`, such as Flax linen's `TrainState` steps.

Each call sorts the arguments into static, kept and donated ones by `jax.jit`'s rules,
makes every Python scalar of a traced argument a weakly typed array (as `jax.jit`
traces it: a new value does not recompile), and calls one `filter_jit` function whose
first argument is never donated and whose second always is.
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Optional, overload, ParamSpec, TypeVar, Union

import jax
import jax.tree_util as jtu

from .._core.errors import OptionError
from .jit import AsMethod, filter_jit, Lowered


_P = ParamSpec("_P")
_T = TypeVar("_T")
_PYTHON_SCALARS = (bool, int, float, complex)


def _as_tuple(value: Any, kind: type) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, kind):
        return (value,)
    return tuple(value)


def _numbers_and_names(
    positional: Sequence[str], numbers: Any, names: Any
) -> tuple[frozenset[int], frozenset[str]]:
    """`jax.jit`'s completion of argument numbers and names through the signature: the
    names of the numbered parameters, and the numbers of the named ones."""
    nums: tuple[int, ...] = _as_tuple(numbers, int)
    strs: tuple[str, ...] = _as_tuple(names, str)
    if numbers is not None and names is None:
        strs = tuple(positional[i] for i in nums if -len(positional) <= i < len(positional))
    elif names is not None and numbers is None:
        nums = tuple(i for i, n in enumerate(positional) if n in strs)
    return frozenset(nums), frozenset(strs)


def _python_scalars_as_arrays(tree: Any) -> Any:
    """Each Python scalar leaf as a weakly typed array, as `jax.jit` traces it
    (`jax.device_put`: `jnp.asarray` would compile a function for each dtype)."""
    return jtu.tree_map(_python_scalar_as_array, tree)


def _python_scalar_as_array(x: Any) -> Any:
    return jax.device_put(x) if isinstance(x, _PYTHON_SCALARS) else x


@dataclasses.dataclass(frozen=True)
class _Static:
    """A static argument, hashed whole (as `jax.jit` hashes it): `filter_jit` would
    hash its leaves one by one, and warn where a number among them changes."""

    value: Any


def _selected(i: int, n_args: int, numbers: frozenset[int]) -> bool:
    return i in numbers or i - n_args in numbers


def _call(fun: Callable[..., Any], fixed: tuple[Any, dict[str, Any]],
          donated: dict[str, Any]) -> Any:
    """`fun` on the arguments `_Jit._sort` sorted, its Python scalars returned as
    arrays (as `jax.jit` returns them)."""
    (labels, keywords), kept = fixed
    arguments = {k: x.value if isinstance(x, _Static) else x
                 for k, x in {**kept, **donated}.items()}
    out = fun(*[arguments[k] for k in labels], **{k: arguments[k] for k in keywords})
    return _python_scalars_as_arrays(out)


class _Jit(AsMethod, Generic[_P, _T]):
    """What `jit` returns."""

    def __init__(self, fun: Callable[_P, _T], static_argnums: Any, static_argnames: Any,
                 donate_argnums: Any, donate_argnames: Any,
                 compiler_options: Optional[dict[str, Any]]) -> None:
        positional: list[str] = []
        try:
            positional = [p.name for p in inspect.signature(fun).parameters.values()
                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):  # no signature: numbers and names as given
            pass
        self._positional = tuple(positional)
        self._static = _numbers_and_names(positional, static_argnums, static_argnames)
        self._donate = _numbers_and_names(positional, donate_argnums, donate_argnames)
        both = (self._static[0] & self._donate[0]) | (self._static[1] & self._donate[1])
        if both:
            raise OptionError(
                f"jit: {sorted(map(str, both))} both static and donated; an argument can "
                "only be one of the two (as in `jax.jit`).")
        self._fun = fun
        self._name = getattr(fun, "__qualname__", repr(fun))

        def call(fixed: tuple[Any, dict[str, Any]], donated: dict[str, Any]) -> Any:
            return _call(fun, fixed, donated)

        # (`filter_jit` names the executable and its messages after these)
        call.__name__ = getattr(fun, "__name__", "fun")
        call.__qualname__ = self._name
        self._jitted = filter_jit(call, donate="warn-except-first",
                                  compiler_options=compiler_options)
        functools.update_wrapper(self, fun)

    def _label(self, i: int) -> str:
        return self._positional[i] if i < len(self._positional) else f"args[{i}]"

    def _sort(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        """`(layout, kept, donated)`: the arguments by label (parameter name, or
        `args[i]` past the named ones), Python scalars of traced ones as arrays."""
        kept: dict[str, Any] = {}
        donated: dict[str, Any] = {}
        labels = []
        for i, x in enumerate(args):
            label = self._label(i)
            labels.append(label)
            static = _selected(i, len(args), self._static[0])
            into = donated if _selected(i, len(args), self._donate[0]) else kept
            into[label] = _Static(x) if static else _python_scalars_as_arrays(x)
        for k, x in kwargs.items():
            if k in kept or k in donated:
                raise TypeError(f"{self._name}() got multiple values for argument {k!r}")
            into = donated if k in self._donate[1] else kept
            into[k] = _Static(x) if k in self._static[1] else _python_scalars_as_arrays(x)
        return (tuple(labels), tuple(kwargs)), kept, donated

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        layout, kept, donated = self._sort(args, kwargs)
        out: _T = self._jitted((layout, kept), donated)
        return out

    def lower(self, *args: _P.args, **kwargs: _P.kwargs) -> Lowered:
        """Lowers the function for these arguments (as `filter_jit(f).lower`): the
        result's `.compile()` has `memory_analysis()`, `cost_analysis()` and
        `as_text()`; call the `jit` function itself to run it."""
        layout, kept, donated = self._sort(args, kwargs)
        return self._jitted.lower((layout, kept), donated)


@overload
def jit(
    *, static_argnums: Union[int, Sequence[int], None] = None,
    static_argnames: Union[str, Iterable[str], None] = None,
    donate_argnums: Union[int, Sequence[int], None] = None,
    donate_argnames: Union[str, Iterable[str], None] = None,
    compiler_options: Optional[dict[str, Any]] = None,
) -> Callable[[Callable[_P, _T]], _Jit[_P, _T]]: ...


@overload
def jit(
    fun: Callable[_P, _T], *, static_argnums: Union[int, Sequence[int], None] = None,
    static_argnames: Union[str, Iterable[str], None] = None,
    donate_argnums: Union[int, Sequence[int], None] = None,
    donate_argnames: Union[str, Iterable[str], None] = None,
    compiler_options: Optional[dict[str, Any]] = None,
) -> _Jit[_P, _T]: ...


def jit(
    fun: Optional[Callable[..., Any]] = None,
    *,
    static_argnums: Union[int, Sequence[int], None] = None,
    static_argnames: Union[str, Iterable[str], None] = None,
    donate_argnums: Union[int, Sequence[int], None] = None,
    donate_argnames: Union[str, Iterable[str], None] = None,
    compiler_options: Optional[dict[str, Any]] = None,
) -> Any:
    """A drop-in for `jax.jit` that is safe to donate host-resident state to.

    It takes `jax.jit`'s arguments and follows its rules: the arguments named by
    `static_argnums`/`static_argnames` are static (hashed), every other leaf is traced,
    Python scalars as weakly typed values (so a Flax linen `TrainState`, whose `step`
    starts as the Python int `0`, compiles once and returns `step` as an int32 array),
    and the arguments named by `donate_argnums`/`donate_argnames` are donated. Like
    `eqx_offload.filter_jit`, whose machinery it uses, it gives JAX input and output
    shardings with memory kinds, so a donated `pinned_host` optimizer state is never
    aliased to a device output (with `jax.jit` that aborts the process).

    Unlike `jax.jit`, leaves that are neither arrays nor Python scalars (strings,
    functions) are static rather than an error.

    **Arguments:**

    - `fun`: a pure function.
    - `static_argnums`, `static_argnames`, `donate_argnums`, `donate_argnames`: as
        `jax.jit` (numbers and names complete each other through `fun`'s signature).
    - `compiler_options`: XLA options for this function's executables, as
        `filter_jit`'s.

    **Returns:**

    The compiled version of `fun` (with `.lower`).

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import optax
        import eqx_offload

        params = {"w": jnp.ones((4, 4))}
        opt = eqx_offload.offloaded(optax.adamw(1e-3))
        state = (params, opt.init(params), 0)

        @eqx_offload.jit(donate_argnums=0)
        def step(state, x):
            params, opt_state, count = state
            grads = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, count + 1

        state = step(state, jnp.ones((2, 4)))
        ```
    """
    if fun is None:
        return functools.partial(
            jit, static_argnums=static_argnums, static_argnames=static_argnames,
            donate_argnums=donate_argnums, donate_argnames=donate_argnames,
            compiler_options=compiler_options)
    return _Jit(fun, static_argnums, static_argnames, donate_argnums, donate_argnames,
                compiler_options)

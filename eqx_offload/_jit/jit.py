"""`filter_jit`: `eqx.filter_jit` with memory-kind-aware shardings, safe to donate
host-resident state to, with an ahead-of-time API (`.lower(...).compile()`).

One call goes one way, as one record (`call.Call`): flattened once
(`call.flatten_call`: array leaves are traced, everything else is static), its
`Signature` looked up in the cache (kept here, above `jax.jit`: the donation abort needs
the shardings `jax.jit` is given), compiled on a miss (`stage.lower_call`, shared with
`lower` and `lower_for`, traces the function once with the arguments' shardings,
analyses the program with `stage.analyse`, and lowers it with input *and* output
shardings that carry memory kinds, so JAX pairs a donated input only with an output in
the same memory; `stage.compile_program` compiles it), and run (`stage.run`: the
executable, the output rebuilt). The user's function runs once per compilation.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast, Generic, Optional, overload, ParamSpec, TypeVar, Union

import equinox as eqx
import jax.tree_util as jtu
from jax.core import Tracer

from .._core.errors import OptionError, SignatureError
from .._core.types import Donate
from .call import Call, flatten_call, FUN, over_one_device_meshes, Signature
from .call import warn_changed_number
from .donation import Donation, parse_donate
from .saved import dumps, loads
from .stage import compile_program, Executable, export_call, lower_call, Program, run


_P = ParamSpec("_P")
_T = TypeVar("_T")


class Compiled:
    """A compiled `filter_jit` function for one configuration of arguments (returned by
    `filter_jit(f).lower(...).compile()`). Call it with arguments of the same structure,
    static values, shapes, dtypes and shardings as those it was lowered for."""

    def __init__(self, executable: Executable, key: Signature, donate: Donation,
                 name: str, fun_arrays: Any = None) -> None:
        self._executable = executable
        self._key = key
        self._donate = donate
        self._name = name
        self._fun_arrays = fun_arrays  # the function's own arrays, passed as `FUN`

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fun_arrays is not None:
            kwargs = {**kwargs, FUN: self._fun_arrays}
        call = flatten_call(args, kwargs, self._donate, name=self._name)
        if call.key != self._key:
            raise SignatureError(
                f"filter_jit({self._name}).lower(...).compile(): called with arguments "
                "that differ from those it was lowered for (tree structure, static "
                "values, shapes, dtypes or shardings). Lower it again for these "
                "arguments, or call the `filter_jit` function itself (it compiles once "
                "per configuration)."
            )
        return run(self._executable, call, self._donate.silence)

    def memory_analysis(self) -> Any:
        """XLA's memory analysis of the executable (`jax.stages.Compiled.memory_analysis`)."""
        return self._executable.compiled.memory_analysis()

    def cost_analysis(self) -> Any:
        """XLA's cost analysis of the executable (`jax.stages.Compiled.cost_analysis`)."""
        return self._executable.compiled.cost_analysis()

    def as_text(self) -> Optional[str]:
        """The compiled program as text (`jax.stages.Compiled.as_text`)."""
        text: Optional[str] = self._executable.compiled.as_text()
        return text

    def serialize(self) -> bytes:
        """The executable and what calling it needs, as bytes: `filter_jit(f).load(data)`
        in a later process (the same backend, device kind and JAX version) returns it
        compiled, without tracing `f`. The function's own arrays are not in them."""
        return dumps(self._executable, self._key, self._donate, self._name)


class Lowered:
    """A `filter_jit` function lowered for one configuration of arguments (returned by
    `filter_jit(f).lower(...)`), as `eqx.filter_jit(f).lower(...)`.

    `jaxpr` is the traced program (as `jax.stages.Traced.jaxpr`) and `compiler_options`
    the XLA options `.compile()` uses: `filter_jit`'s defaults for this program (see the
    "GPU plan" docs page) and the function's own `compiler_options`, which win."""

    def __init__(self, program: Program, key: Signature, donate: Donation, name: str,
                 fun_arrays: Any = None) -> None:
        self._program = program
        self._fun_arrays = fun_arrays
        self.jaxpr = program.jaxpr
        self.compiler_options = program.compiler_options
        self._key = key
        self._donate = donate
        self._name = name

    def compile(self, compiler_options: Optional[dict[str, Any]] = None) -> Compiled:
        """Compiles it, with XLA `compiler_options` for this executable alone (e.g. the
        GPU scheduler's settings; see the "Modes" docs page), added to
        `self.compiler_options` and winning over them."""
        options = {**self.compiler_options, **(compiler_options or {})}
        executable = compile_program(self._program, options, self._donate.silence)
        return Compiled(executable, self._key, self._donate, self._name, self._fun_arrays)

    def as_text(self) -> str:
        """The lowered program (StableHLO) as text."""
        text: str = self._program.lowered.as_text()
        return text

    def compiler_ir(self, dialect: str = "stablehlo") -> Any:
        """The lowered program as an MLIR module (`jax.stages.Lowered.compiler_ir`)."""
        return self._program.lowered.compiler_ir(dialect)


class AsMethod:
    """A callable object that binds an instance as a function does, when it stands as a
    method in a class (`filter_jit` and `jit` as decorators of methods)."""

    def __get__(self, instance: Any, owner: Any) -> Any:
        if instance is None:
            return self
        return functools.partial(cast(Callable[..., Any], self), instance)  # (a subclass's)


class _FilterJit(AsMethod, Generic[_P, _T]):
    """What `filter_jit` returns: call it, or `.lower(...)` it."""

    def __init__(self, fun: Callable[_P, _T], donate: Donation,
                 compiler_options: Optional[dict[str, Any]]) -> None:
        self._fun = fun
        # The function's own arrays (`filter_jit(model)`) are traced, as Equinox's
        # `filter_jit` traces them, not baked into the program as constants: passed as
        # the keyword argument `FUN`, never donated.
        arrays, self._fun_static = eqx.partition(fun, eqx.is_array)
        self._fun_arrays = arrays if jtu.tree_leaves(arrays) else None
        self._traced: Callable[..., Any] = fun if self._fun_arrays is None else self._combined
        self._donate = donate
        self._compiler_options = compiler_options
        self._name = getattr(fun, "__qualname__", repr(fun))
        self._cache: dict[Signature, Executable] = {}
        self._warned = False  # `warn_changed_number`, once per function
        self._nested: Optional[Callable[..., Any]] = None  # see `__call__`
        functools.update_wrapper(self, fun)

    def _combined(self, *args: Any, **kwargs: Any) -> Any:
        """The function, rebuilt from its traced arrays (keyword `FUN`), called."""
        fun = eqx.combine(kwargs.pop(FUN), self._fun_static)
        return fun(*args, **kwargs)

    def _with_fun(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs`, with the function's own arrays under `FUN` where it has any."""
        return kwargs if self._fun_arrays is None else {**kwargs, FUN: self._fun_arrays}

    def _flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        # (The arguments reach `flatten_call` from here and from `_run`, where they are
        # typed as what they are, not as `_P.args`: pytype cannot record a call trace
        # with `ParamSpecArgs`.)
        return flatten_call(args, self._with_fun(kwargs), self._donate, abstract=True,
                            name=self._name)

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        out: _T = self._run(args, kwargs)
        return out

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        flat = jtu.tree_flatten((args, kwargs))
        if any(isinstance(x, Tracer) for x in flat[0]):
            # A traced leaf: called inside an enclosing `jit`, `grad` or `vmap` (the
            # inner function of Optax's meta-learning example): a nested `jax.jit` call,
            # as `eqx.filter_jit`'s, part of the enclosing program (which gives it its
            # shardings and donation, if it has any).
            if self._nested is None:
                self._nested = eqx.filter_jit(self._fun)
            return self._nested(*args, **kwargs)
        if self._fun_arrays is not None:
            kwargs = self._with_fun(kwargs)
            flat = jtu.tree_flatten((args, kwargs))
        call = flatten_call(args, kwargs, self._donate, name=self._name, flat=flat)
        silence = self._donate.silence
        executable = self._cache.get(call.key)
        if executable is None:
            if not self._warned and self._cache:
                self._warned = warn_changed_number(self._cache, call, self._donate, self._name)
            program = lower_call(self._traced, self._name, call, silence, self._compiler_options)
            executable = compile_program(program, program.compiler_options, silence)
            self._cache[call.key] = executable
        return run(executable, call, silence)

    def lower(self, *args: _P.args, **kwargs: _P.kwargs) -> Lowered:
        """Lowers the function for these arguments without running it (ahead-of-time
        compilation). `.compile()` on the result gives a callable `Compiled` with
        `memory_analysis()`, `cost_analysis()` and `as_text()`. The function's call
        cache is not touched. As in `jax.jit(f).lower`, a `jax.ShapeDtypeStruct`
        stands for an array of its shape, dtype and sharding: a step can be compiled
        from `eqx_offload.checkpoint.filter_eval_shape` of the model and state, before
        (or while) `filter_make` makes them. (A spec in host memory on one device
        needs the sharding `filter_eval_shape` gives it, over a one-device mesh: JAX
        traces one of a `SingleDeviceSharding` as device memory.)"""
        return self._lower(self._flatten(args, kwargs))

    def export(self, platforms: Optional[Sequence[str]] = None) -> Callable[..., Any]:
        """`jax.export.export` for this function, memory kinds kept: returns a callable
        that takes the function's arguments and returns a `jax.export.Exported` lowered
        for `platforms` (default: the default backend), with the input and output
        shardings `filter_jit` compiles with. The exported program takes and returns
        the offloaded state in host memory and contains its copies to and from the
        device, for CUDA too. (Exporting `jax.jit(step)` with specs built from the
        state's own shardings drops the memory kinds: its program never copies the
        state to the device; see the "Export" docs page.)

        The `Exported` takes the distinct array leaves of `(args, kwargs)`, in
        `jax.tree.leaves` order, and returns the array leaves of the result.

        !!! Example

            ```python
            import jax.numpy as jnp
            import optax
            import eqx_offload

            params = {"w": jnp.ones((4, 4))}
            opt = eqx_offload.offloaded(optax.adam(1e-3))
            state = opt.init(params)

            @eqx_offload.filter_jit
            def step(params, state):
                updates, state = opt.update(params, state, params)
                return optax.apply_updates(params, updates), state

            exported = step.export(platforms=["cuda"])(params, state)
            assert "annotate_device_placement" in exported.mlir_module()
            ```
        """

        def export(*args: Any, **kwargs: Any) -> Any:
            call = flatten_call(args, self._with_fun(kwargs), self._donate, name=self._name)
            return export_call(self._traced, self._name, call, self._donate.silence, platforms)

        return export

    def lower_for(self, platforms: Sequence[str], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Lowered:
        """`lower(*args, **kwargs)` for other `platforms` than the arguments' own: the
        public hook that `gpu_plan` lowers through (`("cuda",)` with arguments on this
        machine's CPU). A `jax.ShapeDtypeStruct` with a sharding stands for an array:
        nothing is allocated, and the step is traced and lowered as for arrays of that
        shape, dtype and sharding (memory kind included). For `("tpu",)`, a
        `SingleDeviceSharding` is taken as the same device's `NamedSharding` over a
        one-device mesh (libtpu's compile-only device would type a `pinned_host`
        argument of a `SingleDeviceSharding` as device memory), as `plan` does. The
        function's call cache is not touched.

        **Arguments:**

        - `platforms`: the platforms to lower for, e.g. `("cuda",)`.
        - `args`, `kwargs`: the function's arguments (arrays or `jax.ShapeDtypeStruct`s).

        **Returns:**

        A `Lowered`; its `compiler_options` are `filter_jit`'s defaults for the first
        platform and this program, with the function's own.
        """
        if "tpu" in platforms:
            args, kwargs = over_one_device_meshes((args, kwargs))
        call = flatten_call(args, self._with_fun(kwargs), self._donate, abstract=True,
                            name=self._name)
        return self._lower(call, tuple(platforms))

    def load(self, data: bytes) -> Compiled:
        """`Compiled.serialize()`'s bytes, saved from this function (the same name and
        `donate`), loaded as a `Compiled` on this process's devices: nothing is traced or
        compiled (a trusted file only: loading an executable can run any code). A
        start-up reads it while `filter_make` fills host memory (docs/startup.md)."""
        executable, key = loads(data, self._name, self._donate)
        return Compiled(executable, key, self._donate, self._name, self._fun_arrays)

    def _lower(self, call: Call, platforms: Optional[tuple[str, ...]] = None) -> Lowered:
        program = lower_call(self._traced, self._name, call, self._donate.silence,
                             self._compiler_options, platforms)
        return Lowered(program, call.key, self._donate, self._name, self._fun_arrays)


@overload
def filter_jit(
    *, donate: Union[Donate, tuple[str, ...]] = "none", compiler_options: Optional[dict[str, Any]] = None
) -> Callable[[Callable[_P, _T]], _FilterJit[_P, _T]]: ...


@overload
def filter_jit(
    fun: Callable[_P, _T], *, donate: Union[Donate, tuple[str, ...]] = "none",
    compiler_options: Optional[dict[str, Any]] = None,
) -> _FilterJit[_P, _T]: ...


def filter_jit(
    fun: Optional[Callable[..., Any]] = None,
    *,
    donate: Union[Donate, tuple[str, ...]] = "none",
    compiler_options: Optional[dict[str, Any]] = None,
) -> Any:
    """A drop-in for `eqx.filter_jit` that is safe to donate host-resident state to.

    All JAX and NumPy arrays in the arguments are traced, everything else is static
    (as `eqx.filter_jit`). Unlike `eqx.filter_jit`, it hands `jax.jit` input *and*
    output shardings that carry memory kinds, so JAX pairs each donated input only with
    an output in the same memory: a `pinned_host` optimizer state can never be aliased
    to a device output (which aborts the process, see the docs' "donation trap").

    It compiles once per configuration (tree structure, static values, shapes, dtypes,
    shardings and memory kinds): committed and uncommitted arguments of the same
    sharding share one executable. `f.lower(*args, **kwargs)` lowers ahead of time, as
    `eqx.filter_jit(f).lower(...)`: `.compile()` returns a callable with
    `memory_analysis()`. `f.export(platforms=[...])(*args)` exports it with
    `jax.export`, memory kinds and copies kept (see the "Export" docs page).

    An array that stands at several donated leaves (`eqx.nn.State(model)` shares the
    model's arrays) is donated once: the other places get a copy for that call, so the
    call runs where `eqx.filter_jit` fails ("Attempt to donate the same buffer twice"),
    and the executable is the same whatever is shared.

    A module as the function (`filter_jit(model)`, a bound method, an `eqx.Partial`):
    its arrays are traced, as `eqx.filter_jit` traces them, not copied into the program
    as constants, and never donated.

    Called inside another `jit`, `jax.grad` or `jax.vmap` (traced arguments, as the inner
    function of Optax's meta-learning example), it is a nested `eqx.filter_jit` call,
    part of the enclosing program, which gives it its shardings and donation.

    **Arguments:**

    - `fun`: a pure function.
    - `donate`: as `eqx.filter_jit`: `"all"`, `"all-except-first"`, `"warn"`,
        `"warn-except-first"` or `"none"` (default). `"all"` and
        `"all-except-first"` silence JAX's warning about donated buffers it could not
        reuse; the `"warn"` modes keep it. Or a tuple of parameter names (as
        `jax.jit`'s `donate_argnames`): those arguments are donated, the others not,
        e.g. `donate=("discriminator", "opt_state")` for a step that reads a second
        model it does not return (Equinox's DCGAN: `donate="all"` would consume it).
        An array that an earlier donating call consumed raises `DonationError` naming
        its argument and leaf, where JAX says "Array has been deleted".
    - `compiler_options`: XLA options for this function's executables alone (as
        `jax.jit(f).lower(...).compile(compiler_options=...)`), e.g. the GPU
        latency-hiding scheduler's (see the "Modes" docs page). Default `None`. For a
        GPU step that streams an `offloaded` state (its default), `filter_jit` adds
        two options of its own, which these override: XLA's scheduler's limit on
        copies in flight (`xla_gpu_experimental_parallel_async_compute_limit=32`,
        XLA's default 2) and `xla_gpu_dot_merger_threshold_mb=0`; for one that brings
        such a state whole (`group_bytes=None`),
        `xla_gpu_enable_analytical_sol_latency_estimator=False`, so its copies do not
        all start before the forward pass (see the "GPU plan" docs page). On the CPU it adds
        nothing.

    **Returns:**

    The compiled version of `fun` (with `.lower`).

    **Raises:**

    `OptionError` for an unknown `donate` (or a name that is not a parameter of
    `fun`). `DonationError` for an argument that an earlier donating call deleted.
    `CompositionError` at the first call if `fun` computes on a host-resident array
    (anything but moving it, placing it, or passing it through a call, `cond`, `while`
    or `scan`) outside `compute_on(..., compute_type="device_host")`: on a GPU, XLA
    would run that on the host or refuse to compile it. The usual cause is a
    combinator that computes on the state of what it wraps placed around `offloaded`,
    such as `optax.MultiSteps(offloaded(...))`; the message names the operation, where
    it is, and the fix for that kind of operation.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import optax
        import eqx_offload

        model = eqx.nn.Linear(4, 4, key=jax.random.key(0))
        opt = eqx_offload.offloaded(optax.adamw(1e-3))
        state = opt.init(eqx.filter(model, eqx.is_array))

        @eqx_offload.filter_jit(donate="all")
        def step(model, state, x):
            grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
            updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state

        compiled = step.lower(model, state, jnp.ones(4)).compile()
        print(compiled.memory_analysis())
        model, state = step(model, state, jnp.ones(4))
        ```
    """
    donation = parse_donate(donate, fun)  # (checked here, also for the decorator form)
    if compiler_options is not None and not isinstance(compiler_options, dict):
        raise OptionError(
            f"filter_jit(compiler_options={compiler_options!r}): compiler_options must be "
            "a dict of XLA option names to values, or None."
        )
    if fun is None:
        return functools.partial(filter_jit, donate=donate, compiler_options=compiler_options)
    return _FilterJit(fun, donation, compiler_options)

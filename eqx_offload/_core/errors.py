"""Exceptions raised by `eqx_offload`.

Every one is an `OffloadError`, so one `except eqx_offload.OffloadError` catches them
all. Each also subclasses the built-in exception a caller would expect from the same
mistake elsewhere (`ValueError` for a bad value, `TypeError` for a wrong kind of
object), so existing `except ValueError` / `except TypeError` code keeps working.
"""


class OffloadWarning(UserWarning):
    """A call that is valid but surely not what was meant: a state leaf that should be
    in host memory found in device memory, a `where` that selects nothing, a move of
    nothing."""


class OffloadError(Exception):
    """Base class of every error raised by `eqx_offload`."""


class OptionError(OffloadError, ValueError, TypeError):
    """A bad option of `offloaded`, `filter_jit` or another function: a value out of
    range or of the wrong type (hence both `ValueError` and `TypeError`)."""


class MemoryKindError(OffloadError, ValueError):
    """A memory kind that does not exist, or that the device does not offer."""


class WhereError(OffloadError, ValueError):
    """A `where` filter spec that is not a filter, or whose structure does not match the
    tree it is applied to."""


class TreeError(OffloadError, TypeError):
    """Something passed where a pytree is expected that cannot be one (e.g. a generator,
    which JAX would treat as a single opaque leaf and which a move would skip)."""


class SignatureError(OffloadError, TypeError):
    """Arguments to `filter_jit(f).lower(...).compile()` whose structure, static
    values, shapes, dtypes or shardings differ from those it was lowered for."""


class TracedMoveError(OffloadError, ValueError):
    """A move that JAX cannot express inside `jax.jit` (e.g. to `unpinned_host`)."""


class StateError(OffloadError, TypeError):
    """A state passed to `offloaded(...).update` that this transformation did not make."""


class NotATransformationError(OffloadError, TypeError):
    """Something that is not an `optax.GradientTransformation` passed to `offloaded`."""


class CompositionError(OffloadError, ValueError):
    """A composition that cannot work with offloaded state: a computation on
    host-resident arrays, an update that cannot be streamed, a transformation of the
    step (such as `pmap`) that JAX cannot combine with memory kinds."""


class NotStreamable(CompositionError):
    """(Private.) The update cannot be streamed (it couples all of its state, has side
    effects, changes its state's structure or dtypes): `group_bytes=N` raises it; the
    default `"auto"` catches it alone and updates the whole state, the documented mode
    for such an update (a test pins that plan). Any other error comes through."""


class CheckpointError(OffloadError, ValueError):
    """A checkpointed leaf that does not fit its restore target (another shape or dtype),
    or a restore target that cannot be built."""


class DonationError(OffloadError, RuntimeError):
    """An array passed to a `filter_jit` function that an earlier donating call
    consumed (deleted): JAX's "Array has been deleted", with the argument, the leaf's
    path and the fix."""


class PlanError(OffloadError, RuntimeError):
    """`plan` cannot compile for the target: its compiler is missing (a GPU's: the `plan`
    extra; a TPU's: libtpu) or does not match the installed JAX, the step cannot be
    planned, or (on a TPU) it does not fit the chip's HBM."""


# ----------------------------------------------------------------------------------------
# The messages of the mistakes a newcomer makes: the fix first, then where (argument,
# leaf path), then the docs section that explains it, in at most 4 lines and 80 words.

DOCS_URL = "https://eqx-offload.readthedocs.io/en/latest/"
"""The hosted docs (`[project.urls] Documentation` in pyproject.toml, `site_url` in
mkdocs.yml): every link in a message starts here."""

DOCS = "docs/errors.md"
"""The page the messages below link to, as a path in the repository (the docs site is
built from `docs/`); each mistake has a section with a fixed anchor there."""


def docs_link(page: str, anchor: str = "") -> str:
    """The hosted URL of a docs page (`"errors.md"`, a path under `docs/`) and section:
    `docs_link("errors.md", "pmap")` is `DOCS_URL + "errors/#pmap"` (MkDocs serves
    `a/b.md` at `a/b/`, `index.md` at the directory)."""
    path = page.removesuffix(".md")
    path = "" if path == "index" else path.removesuffix("/index") + "/"
    return DOCS_URL + path + (f"#{anchor}" if anchor else "")


def see(anchor: str) -> str:
    """The docs link that ends a message: `"See <DOCS_URL>errors/#<anchor>."`."""
    return f"See {docs_link(DOCS.removeprefix('docs/'), anchor)}."


def foreign_donation_error(name: str) -> CompositionError:
    """`offloaded(...).update` traced under a plain donating jit (`eqx.filter_jit(donate=
    ...)`, `jax.jit(donate_argnums=...)`, `nnx.jit`): JAX would pair a donated host
    buffer with a device output and XLA abort the process. Raised while tracing."""
    return CompositionError(
        'Jit the step with `eqx_offload.filter_jit(step, donate="all")` (Flax NNX: its '
        "functional API, `nnx.split`/`nnx.merge` inside that step).\n"
        f"offloaded(...).update is traced for a jit that donates ({name}); it passes JAX "
        "no memory kinds, so XLA would abort the process. Nothing has run.\n"
        + see("a-jit-that-donates")
    )


def device_state_error(path: str) -> CompositionError:
    """A host-resident state leaf that arrived in device memory under `pmap` (or another
    transformation with named axes), which places every argument on the device."""
    return CompositionError(
        "Use `eqx_offload.filter_jit` with sharded arguments instead of pmap "
        "(`jax.shard_map` inside it works).\n"
        f"offloaded(...).update: state leaf inner_state/{path} arrived in device memory "
        "under a transformation with named axes (`pmap`, `shard_map`, `vmap(axis_name=...)`).\n"
        + see("pmap")
    )


def where_signature_error(argument: str, fn: object, at: str, takes: str) -> WhereError:
    """A `where` callable that cannot be called with one leaf: it `takes` no argument
    (`lambda: True`), more than one (`(path, leaf)`) or a keyword-only one."""
    return WhereError(
        "Give `where` a callable of one argument, the leaf, that returns a bool, e.g. "
        "`lambda x: x.ndim > 1`, or a bool; select by path with `eqx_offload.pattern(regex)`.\n"
        f"{argument}: {_name(fn)} at path {at} takes {takes}.\n"
        + see("where-callables")
    )


def where_dtype_error(argument: str, dtype: object, at: str) -> WhereError:
    """A dtype (`jnp.float32`) given as a `where`."""
    return WhereError(
        f"Select by dtype with `where=lambda x: x.dtype == jnp.{_name(dtype)}`.\n"
        f"{argument}: {_name(dtype)} at path {at} is a dtype, not a filter.\n"
        + see("where-callables")
    )


def where_result_error(argument: str, fn: object, result: object, at: str) -> WhereError:
    """A `where` callable that returned something else than a bool for a leaf (an array,
    which under `jit` is a tracer that has no truth value)."""
    return WhereError(
        "Make the `where` callable return a Python bool for each leaf, e.g. `lambda x: "
        "x.ndim > 1`.\n"
        f"{argument}: {_name(fn)} returned {type(result).__name__}, not a bool, for the "
        f"leaf at path {at}.\n"
        + see("where-callables")
    )


def selects_nothing_message(argument: str, where: object, paths: list[str]) -> str:
    """The `OffloadWarning` for a `where` that selects no array leaf of a tree that has
    some: most often a `pattern` of a name (`"mu"`) where it matches whole paths."""
    shown_paths = ", ".join(repr(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
    regex = getattr(where, "regex", None)
    fix = (f'`pattern(".*{regex}.*")`' if isinstance(regex, str)
           else '`pattern(".*mu.*")` (a regex over whole paths)')
    return (
        f"Use a `where` that matches some leaf, e.g. {fix}: `pattern` matches whole paths.\n"
        f"{argument}={where!r} selects no array leaf, so nothing moves. Paths: "
        f"{shown_paths}\n" + see("a-where-that-selects-nothing")
    )


def nothing_to_move_message(function: str, count: int) -> str:
    """The `OffloadWarning` for `to_host`/`to_device` of a tree of leaves none of which is
    an array (`[1, 2, 3]`, `3.0`): it is returned as it is."""
    return (
        f"Make arrays first, e.g. `{function}(jnp.asarray(x))` or `jax.device_put(x)`.\n"
        f"{function}: none of the tree's {count} leaves is an array, so nothing moved "
        "(non-array leaves are returned as they are).\n" + see("nothing-to-move")
    )


def deleted_array_error(function: str, argument: str, leaf: str, array: str) -> DonationError:
    """An array passed to `function` (`"filter_jit(step)"`, `"offloaded(...).init"`) that an
    earlier donating call consumed: JAX would only say "Array has been deleted"."""
    return DonationError(
        "Pass the value the donating call returned in its place (a donating call consumes "
        "every array passed to it); to keep one it only reads, donate only what it returns, "
        'by name: `filter_jit(step, donate=("model", "opt_state"))`.\n'
        f"{function}: {argument}, leaf {leaf} ({array}) has been deleted by an earlier "
        "call that donated it.\n" + see("a-donated-array")
    )


def not_a_transformation_error(call: str, inner: object) -> NotATransformationError:
    """Something that is not an optax transformation given as `inner` (most often the
    factory `optax.adamw` itself, not called)."""
    kind = f"{type(inner).__module__}.{type(inner).__qualname__}"
    fix = ("If it is an optimizer factory such as `optax.adamw`, call it first "
           "(`optax.adamw(1e-3)`)" if callable(inner)
           else "Pass an optax.GradientTransformation, e.g. `optax.adamw(1e-3)`")
    return NotATransformationError(
        f"{fix}.\n{call}: got {kind}, which is not an optax.GradientTransformation.\n"
        + see("not-a-transformation")
    )


def host_compute_error(function: str, described: str, fix: str) -> CompositionError:
    """A step that computes on a host-resident array (`described`: the operation, its
    operands and where in the source), which XLA runs on the host or refuses."""
    return CompositionError(
        f"{fix}\n{function}: {described} computes on host-resident arrays; state that "
        "`offloaded` keeps in host memory may only be moved (to compute on the host on "
        "purpose: `jax.experimental.compute_on.compute_on(compute_type='device_host')`).\n"
        + see("host-resident-arrays")
    )


_CHECKPOINT_FIX = ("Build `like` for the same model and optimizer that wrote the checkpoint "
                   "(e.g. `eqx_offload.checkpoint.abstract_init(opt, params)`).")


def checkpoint_leaf_error(function: str, leaf: str, held: str, expected: str) -> CheckpointError:
    """A checkpointed leaf (`held`: its dtype and shape) that does not fit its restore
    target (`expected`)."""
    return CheckpointError(
        f"{_CHECKPOINT_FIX}\n{function}: leaf {leaf}: the checkpoint holds {held} where "
        f"`like` has {expected}.\n" + see("a-checkpoint-that-does-not-fit")
    )


def none_leaf_error(leaf: str, state_path: str) -> StateError:
    """`offloaded(...).update` with a state `init` made from a leaf that is not an array
    (the whole model given to `init`, a Python float among its leaves), whose gradient is
    `None`: the state does belong to this optimizer, the updates lack that leaf."""
    return StateError(
        "Initialise with the model's arrays only: `tx.init(eqx.filter(model, eqx.is_array))`.\n"
        f"offloaded(...).update(updates=...): leaf {leaf} is None (the gradient of a leaf "
        "that is not an array, such as a Python float dropout rate), but `init` made state "
        f"for it at inner_state/{state_path}.\n" + see("a-non-array-leaf")
    )


def host_weights_error(function: str, described: str, leaf: str) -> CompositionError:
    """A step that computes on a model weight moved to host memory (`to_host(model)`,
    `leaf`: its argument and path), not on an optimizer state."""
    return CompositionError(
        "Keep model weights in host memory with `eqx_offload.host_weights(module)` (each "
        "weight comes to the device while the module computes) or `eqx_offload.scan_layers` "
        "(stacked layers, fetched in turn); or call the model on the device: "
        "`eqx_offload.to_device(model)`.\n"
        f"{function}: {described} computes on a model weight in host memory: {leaf} "
        "(not an optimizer state).\n" + see("host-resident-arrays")
    )


def host_value_error(function: str, described: str, name: str) -> CompositionError:
    """A step that computes on a value it made in host memory (`name`: the variable
    that holds it, or `""`), such as the gradient of a weight moved with `to_host`."""
    value = f"`{name}`" if name else "the value"
    call = f"eqx_offload.to_device({name or 'x'})"
    return CompositionError(
        f"Bring {value} to the device before computing on it: `{call}` (the gradient of a "
        "weight in host memory is in host memory too: sum micro-batch gradients as "
        f"`acc + eqx_offload.to_device(g)`).\n{function}: {described} computes on "
        f"{value}, made in the step in host memory (not an argument of the step).\n"
        + see("host-resident-arrays")
    )


def _name(obj: object) -> str:
    return str(getattr(obj, "__name__", None) or type(obj).__name__)

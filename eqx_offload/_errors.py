"""Exceptions raised by `eqx_offload`.

Every one is an `OffloadError`, so one `except eqx_offload.OffloadError` catches them
all. Each also subclasses the built-in exception a caller would expect from the same
mistake elsewhere (`ValueError` for a bad value, `TypeError` for a wrong kind of
object), so existing `except ValueError` / `except TypeError` code keeps working.
"""


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


class CheckpointError(OffloadError, ValueError):
    """A checkpointed leaf that does not fit its restore target (another shape or dtype),
    or a restore target that cannot be built."""


class DonationError(OffloadError, RuntimeError):
    """An array passed to a `filter_jit` function that an earlier donating call
    consumed (deleted): JAX's "Array has been deleted", with the argument, the leaf's
    path and the fix."""


class PlanError(OffloadError, RuntimeError):
    """`gpu_plan` cannot compile for the GPU: the compiler is missing (the `plan` extra)
    or does not match the installed JAX, or the step cannot be planned."""

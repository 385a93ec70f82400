"""Exceptions raised by `eqx_offload`. Each subclasses `ValueError` or `TypeError`, so a
caller can catch them with the built-in types too."""


class OffloadError(Exception):
    """Base class of every error raised by `eqx_offload`."""


class MemoryKindError(OffloadError, ValueError):
    """A memory kind that does not exist, or that the device does not offer."""


class WhereError(OffloadError, ValueError):
    """A `where` filter spec that is not a filter, or whose structure does not match the
    tree it is applied to."""


class TracedMoveError(OffloadError, ValueError):
    """A move that JAX cannot express inside `jax.jit` (e.g. to `unpinned_host`)."""


class StateError(OffloadError, TypeError):
    """A state passed to `offloaded(...).update` that this transformation did not make."""


class NotATransformationError(OffloadError, TypeError):
    """Something that is not an `optax.GradientTransformation` passed to `offloaded`."""


class CompositionError(OffloadError, ValueError):
    """A composition of optax combinators that cannot work with offloaded state."""


class CheckpointError(OffloadError, ValueError):
    """A checkpointed leaf that does not fit its restore target (another shape or dtype),
    or a restore target that cannot be built."""

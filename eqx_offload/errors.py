"""The errors `eqx_offload` raises, and its one warning. Each error subclasses
`OffloadError` (also exported at the top level) and the built-in exception it stands
for (`ValueError`, `TypeError`, `RuntimeError`), so existing handlers keep working.
What each means and how to fix it: the docs' "Errors" page.
"""

from ._core.errors import (
    CheckpointError as CheckpointError,
    CompositionError as CompositionError,
    DonationError as DonationError,
    MemoryKindError as MemoryKindError,
    NotATransformationError as NotATransformationError,
    OffloadError as OffloadError,
    OffloadWarning as OffloadWarning,
    OptionError as OptionError,
    PlanError as PlanError,
    SignatureError as SignatureError,
    StateError as StateError,
    TracedMoveError as TracedMoveError,
    TreeError as TreeError,
    WhereError as WhereError,
)


__all__ = [
    "CheckpointError",
    "CompositionError",
    "DonationError",
    "MemoryKindError",
    "NotATransformationError",
    "OffloadError",
    "OffloadWarning",
    "OptionError",
    "PlanError",
    "SignatureError",
    "StateError",
    "TracedMoveError",
    "TreeError",
    "WhereError",
]

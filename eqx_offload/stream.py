"""The streamed update's knobs: its plan of groups (`stream_plan`, `StreamPlan`), the
prefetch options for a device budget (`prefetch_options`) and the whole-state check
(`within_budget`). See the docs' "Streamed update" page.
"""

from ._optim.budget import prefetch_options as prefetch_options, within_budget as within_budget
from ._stream import StreamPlan as StreamPlan
from ._stream import stream_plan as stream_plan


__all__ = ["prefetch_options", "stream_plan", "StreamPlan", "within_budget"]

"""The engine: what runs inside a step, the streamed update (an update's jaxpr analysed
into groups and run group by group), the prefetched layer scan and the update inside
the backward pass. The rest of the package reaches it through this module alone."""

from . import separable as separable
from .backward import Hook as Hook, hook_for as hook_for, hooked as hooked
from .backward import update_scan as update_scan
from .layers import layer_scan as layer_scan, offload_input as offload_input
from .separable import BLOCK as BLOCK, Mark as Mark, REST as REST, SHARED as SHARED
from .update import host_update as host_update, streamed_update as streamed_update
from .update import stream_plan as stream_plan, StreamPlan as StreamPlan
from .update import Transfers as Transfers

"""Rematerialisation with offloading policies: `filter_remat` (also at the top level)
and the policies that keep chosen intermediate values in host memory between the
forward and the backward pass. See the docs' "Weights, master weights and activations
in host memory" page.
"""

from ._models.remat import (
    filter_remat as filter_remat,
    LAYER_INPUT as LAYER_INPUT,
    offload_dots as offload_dots,
    offload_names as offload_names,
    offload_regex as offload_regex,
    Policy as Policy,
)


__all__ = ["filter_remat", "LAYER_INPUT", "offload_dots", "offload_names", "offload_regex",
           "Policy"]

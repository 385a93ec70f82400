"""Saving and restoring offloaded states and models: restore targets that carry host
shardings (for orbax), a deserialise filter spec and `tree_deserialise_leaves` (for
Equinox's serialisation), and abstract states to restore into. See the docs'
"Save and restore checkpoints" page.
"""

from ._checkpoint import (
    abstract_init as abstract_init,
    deserialise_filter_spec as deserialise_filter_spec,
    filter_eval_shape as filter_eval_shape,
    host_shardings as host_shardings,
    restore_target as restore_target,
    tree_deserialise_leaves as tree_deserialise_leaves,
)


__all__ = [
    "abstract_init",
    "deserialise_filter_spec",
    "filter_eval_shape",
    "host_shardings",
    "restore_target",
    "tree_deserialise_leaves",
]

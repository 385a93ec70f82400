"""`offloaded`: the optax transformation, its options, state, layout and update strategies."""

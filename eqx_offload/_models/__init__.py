"""The model techniques: `scan_layers`, host parameters, `master_weights`, remat policies."""

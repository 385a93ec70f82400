"""The planner: compiling a step for a GPU or a TPU without one (`deviceless`, `tpu`),
and reading what XLA's plan holds and moves (`hlo`, `loops`) into a `Plan` (`plan`)."""

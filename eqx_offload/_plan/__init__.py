"""The planner: compiling a step for a GPU or a TPU without one (`deviceless`, `tpu`),
reading what XLA's plan holds and moves (`hlo`, `loops`, `flops`) into a `Plan`
(`plan`, `result`, with its text in `summary`), and the step time a v5e plan predicts
(`timing`)."""

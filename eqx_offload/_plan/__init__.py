"""`gpu_plan`: compiling a step for an NVIDIA GPU without one, and reading what it holds."""

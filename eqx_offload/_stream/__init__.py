"""The engine of the streamed and fused updates: what runs inside a step."""

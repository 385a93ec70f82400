"""The engine: what runs inside a step, the streamed update (an update's jaxpr analysed
into groups and run group by group) and the update inside the backward pass."""

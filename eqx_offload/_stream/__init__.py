"""The streaming engine: an update's jaxpr analysed into groups and run group by group."""

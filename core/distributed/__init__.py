"""The backends that place policies and engines: in-process, or on a Ray cluster
with its worker and engine actors."""

"""Training frameworks that own the loop: what each needs from a ``StreamingLoader`` to keep
its resume exact (docs/integrations.md). Each module imports its framework lazily, if at all:
streamforge never depends on one."""

"""Pipeline stages of one worker: read -> shuffle -> interleave -> pack."""

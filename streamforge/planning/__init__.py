"""Planning: which records each (rank, worker) reads in a pass, and the mixture by step (pure functions of manifests, seed and topology)."""

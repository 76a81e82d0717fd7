"""Storage: fsspec access, ranged reads with retries, prefetch and a local cache."""

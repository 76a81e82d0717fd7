"""The shard format: tar members, zstd frames with a seek index, the manifest."""

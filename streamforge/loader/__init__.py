"""The loader: a rank's batches on the job clock, worker processes, device feed, counters."""

"""Start-up requests do not grow with the number of ranks: real ``torchrun`` jobs of 1, 2 and 4
processes (CPU, gloo) over the loopback S3 server, each rank behind a counting proxy of its own
(``tools/bench_startup.py``), counted up to each rank's first batch.

The manifests are read once for the job (rank 0 broadcasts them); a rank reads a record index
for each shard it reads data from, plus at most those its own cuts fall in (the ranks plan
together), never the index of every shard some other rank's cut falls in."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_startup  # noqa: E402


@pytest.fixture(scope="module")
def corpus(s3_server):
    bucket = s3_server.new_bucket("startup")
    return bench_startup.write_corpus(s3_server, bucket)


def test_startup_requests_grow_with_shards_read_not_ranks(s3_server, corpus):
    streams = len(corpus)
    jobs = {r: bench_startup.run_job(s3_server, corpus, r) for r in (1, 2, 4)}
    for line in bench_startup.table(list(jobs.values())):
        print(line)
    for ranks, job in jobs.items():
        assert job["steps_agree"]
        t = bench_startup.totals(job)
        assert t["manifest"][0] == streams, "the manifests are read once for the job, by rank 0"
        assert all(r["manifest"][0] == 0 for r in job["per_rank"][1:])
        for r in job["per_rank"]:
            # the record indexes a rank reads are of its own shards (read ahead of its data:
            # how many have gone out by the first batch is a race), plus the shard its own last
            # cut falls in, per stream (one worker a rank: its first cut falls in the shard it
            # starts reading); a rank planning alone reads every cut's (tools/bench_startup.py's
            # "alone" rows). Each is read once, give or take a race between two sources of one
            # process before they share what they read.
            assert r["foreign_indexes"] <= streams, (ranks, r)
            assert r["index"][0] <= r["index_shards"] + streams, (ranks, r)
        assert t["index"][0] <= sum(r["index_shards"] for r in job["per_rank"]) + streams * ranks
        assert t["requests"] <= streams + t["index"][0] + t["data"][0] + t["other"][0]
    one, four = bench_startup.totals(jobs[1]), bench_startup.totals(jobs[4])
    # the job's total grows as the shards its ranks read, not as ranks x what one rank reads
    per_shard_one = one["requests"] / one["shards_read"]
    assert four["requests"] <= 1.25 * per_shard_one * four["shards_read"] + 2 * streams * 4

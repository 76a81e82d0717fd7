"""Text read from and shards written to GCS (the fake-gcs-server of tests/helpers/gcs_server.py):
jsonl.gz files and parquet row groups straight from the bucket, same bytes as from disk."""

from __future__ import annotations

import fsspec
import pytest

pytest.importorskip("tokenizers", reason="text conversion tests need the 'text' extra (tokenizers)")

from helpers.gcs_server import gcs_server  # noqa: E402, F401  (fixture)
from helpers.text import make_docs, split_files, train_hf, write_text_parquet  # noqa: E402

from streamforge.convert import convert  # noqa: E402


def test_text_from_and_to_gcs(tmp_path, rng, gcs_server):
    server = gcs_server
    docs = make_docs(rng, 300)
    hf_tok = train_hf(tmp_path / "tokenizer.json", docs)
    opts = server.storage_options()
    bucket = server.new_bucket()
    split_files(tmp_path / "in", docs, 2, ".jsonl.gz")
    (tmp_path / "in-pq").mkdir()
    write_text_parquet(tmp_path / "in-pq" / "docs.parquet", docs, row_group_size=150)
    fs = fsspec.filesystem("gs", **opts)
    fs.put(str(tmp_path / "in"), f"{bucket}/in", recursive=True)
    fs.put(str(tmp_path / "in-pq" / "docs.parquet"), f"{bucket}/pq/docs.parquet")
    for fmt, src in (("jsonl", "in"), ("parquet", "pq")):
        remote = convert(fmt, f"gs://{bucket}/{src}", f"gs://{bucket}/out-{fmt}", text_field="text",
                         tokenizer=hf_tok, shard_size="16KiB", workers=2, storage_options=opts,
                         progress=False)
        local = convert(fmt, tmp_path / ("in" if fmt == "jsonl" else "in-pq"), tmp_path / f"out-{fmt}",
                        text_field="text", tokenizer=hf_tok, shard_size="16KiB", progress=False)
        assert remote.shard_sha256 == local.shard_sha256 and remote.num_records == 300

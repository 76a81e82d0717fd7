"""What the tests share, importable as ``helpers.*`` (pytest.ini puts tests/ on sys.path).

- ``pipeline``: tiny real corpora, datasets and loaders for the pipeline tests.
- ``format``, ``storage``, ``convert``, ``text``: helpers of tests/format, tests/storage and
  tests/convert (shard writers, corpora, source files in each converter's format, tokenizers).
- ``s3_server``: the session's S3 server (``streamforge.demo.s3.LoopbackS3``), the fixtures
  ``s3_server`` and ``s3_bucket``, and ``free_port``.
- ``gcs_server``: fake-gcs-server on 127.0.0.1 and the ``gcs_server`` fixture.
- ``fault_proxy``: a fault-injecting HTTP proxy in front of the S3 server.
- ``workers/``: scripts the tests launch in other processes (torchrun ranks, killed and
  restarted jobs), run by path: ``dist_worker.py``, ``dcp_worker.py``, ``eval_worker.py``,
  ``ledger_dist_worker.py``.
"""

"""Local reads go through ``open`` (storage/local.py): the same records as fsspec's local
filesystem, and a pass over local shards that never imports fsspec."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers.storage import config, read_all, same, tokens_of, write_corpus
from streamforge.source import ShardSource
from streamforge.storage.local import LocalReader
from streamforge.storage.open import open_url


def test_local_reader_and_fsspec_read_the_same_records(tmp_path, docs):
    url = str(tmp_path / "web")
    write_corpus(url, docs)
    for given in (url, f"file://{url}"):
        ours = ShardSource.open(given, None, config())
        theirs = ShardSource.open(given, None, config(client="fsspec"))
        assert isinstance(ours.fetcher._open()[0], LocalReader)
        assert not isinstance(theirs.fetcher._open()[0], LocalReader)
        a, b = read_all(ours), read_all(theirs)
        assert same(tokens_of(a), docs) and same(tokens_of(a), tokens_of(b))
        ours.close()
        theirs.close()


def test_local_reader_answers_like_fsspec(tmp_path):
    (tmp_path / "f").write_bytes(b"0123456789")
    ours, path = open_url(f"file://{tmp_path}/f", client="auto")
    theirs, _ = open_url(str(tmp_path / "f"))
    assert path == str(tmp_path / "f")
    for args in ((), (2, 5), (8, 20), (12, 20)):
        assert ours.cat_file(path, *args) == theirs.cat_file(path, *args)
    assert ours.size(path) == theirs.size(path) == 10
    assert ours.exists(path) and not ours.exists(path + "x")


def test_a_local_pass_never_imports_fsspec(tmp_path, docs):
    url = str(tmp_path / "web")
    write_corpus(url, docs)
    code = textwrap.dedent(f"""
        import sys
        from streamforge import PackedTokenDataset, StreamingLoader
        loader = StreamingLoader(PackedTokenDataset({url!r}, seq_len=64, seed=0, eos_id=0), batch_size=4)
        assert sum(1 for _ in loader) > 10
        print("fsspec" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

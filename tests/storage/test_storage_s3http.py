"""S3 reads as signed HTTP requests (``StorageConfig.client="http"``, storage/s3http.py): the
same bytes as s3fs, signatures an S3 server that checks them accepts, the errors the retry
policy sorts, proxies, and threads racing for a new reader (real S3 servers on 127.0.0.1). A
worker forked after obstore's requests reading through it: test_storage_obstore.py."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys
import time
from urllib.parse import urlsplit

import pytest

from helpers.s3_server import free_port
from helpers.storage import config, read_all, same, tokens_of, write_corpus
from streamforge.errors import ConfigError, ManifestError, StorageError
from streamforge.source import ShardSource
from streamforge.storage import objstore
from streamforge.storage.config import RetryPolicy
from streamforge.storage.open import open_url
from streamforge.storage.s3http import S3HttpReader


def _kind(url, opts, client):
    return type(open_url(url, opts, RetryPolicy(), client)[0]).__name__


def test_http_reads_the_same_records_as_s3fs(s3_corpus, docs):
    url, opts, _ = s3_corpus
    http = ShardSource.open(url, opts, config(client="http"))
    slow = ShardSource.open(url, opts, config(client="fsspec"))
    assert isinstance(http.fetcher._open()[0], S3HttpReader)
    a, b = read_all(http), read_all(slow)
    assert same(tokens_of(a), docs) and same(tokens_of(a), tokens_of(b))
    stats = http.stats()
    assert stats["bytes_fetched"] == slow.stats()["bytes_fetched"] > 0
    assert stats["http_requests"] == stats["requests"] > 0 and stats["obstore_requests"] == 0
    assert slow.stats()["http_requests"] == 0
    http.close()
    slow.close()


def test_errors_are_the_ones_the_retry_policy_sorts(s3_corpus):
    url, opts, _ = s3_corpus
    reader, path = open_url(url, opts, RetryPolicy(), "http")
    index = f"{path}/index.json"
    size = reader.size(index)
    whole = reader.cat_file(index)
    assert len(whole) == size and reader.cat_file(index, 3, 11) == whole[3:11]
    assert reader.cat_file(index, 5, 5) == b""
    assert reader.exists(index) and reader.exists(path.split("/")[0])
    assert not reader.exists(f"{path}/nothing.json") and not reader.exists("no-such-bucket-here")
    with pytest.raises(FileNotFoundError, match=r"s3://.*/web/nothing.json: HTTP 404 NoSuchKey"):
        reader.cat_file(f"{path}/nothing.json", 0, 10)
    with pytest.raises(OSError) as info:  # a range past the end: fetch.py then checks the size
        reader.cat_file(index, size + 10, size + 20)
    assert info.value.errno == errno.EINVAL and "416" in str(info.value)
    with pytest.raises(ValueError, match="both start and end"):
        reader.cat_file(index, 0, None)


def test_a_refused_connection_is_transient_and_named(tmp_path):
    port = free_port()  # nothing listens there
    opts = {"key": "a", "secret": "b", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    quick = RetryPolicy(attempts=2, backoff_base=0.01, timeout=1.0)
    with pytest.raises(StorageError, match=r"s3://bucket/web/index.json.*giving up after 2 attempts.*ConnectionError"):
        ShardSource.open("s3://bucket/web", opts, config(client="http", retry=quick))


def test_addresses_path_style_virtual_hosted_and_dotted():
    on_aws = S3HttpReader({"access_key_id": "a", "secret_access_key": "b", "region": "eu-west-1",
                           "virtual_hosted_style_request": True}, RetryPolicy())
    assert on_aws.url("plain", "web/a b/ü.json") == "https://plain.s3.eu-west-1.amazonaws.com/web/a%20b/%C3%BC.json"
    assert on_aws.url("my.bucket", "web/x") == "https://s3.eu-west-1.amazonaws.com/my.bucket/web/x"
    assert on_aws.url("plain") == "https://plain.s3.eu-west-1.amazonaws.com/"
    local = S3HttpReader({"access_key_id": "a", "secret_access_key": "b", "region": "us-east-1",
                          "endpoint": "http://127.0.0.1:9000/"}, RetryPolicy())
    assert local.url("b", "k~1") == "http://127.0.0.1:9000/b/k~1" and local.url("b") == "http://127.0.0.1:9000/b"


def test_the_reader_pickles_and_builds_its_pool_where_it_is_used(s3_corpus):
    url, opts, _ = s3_corpus
    reader, path = open_url(url, opts, RetryPolicy(timeout=7.0), "http")
    reader.size(f"{path}/index.json")
    copy = pickle.loads(pickle.dumps(reader))
    assert copy._pools == {} and copy._pool_pid is None and copy._timeout == 7.0
    assert copy.cat_file(f"{path}/index.json") == reader.cat_file(f"{path}/index.json")


def test_auto_takes_http_where_obstore_is_not_installed(s3_corpus, monkeypatch):
    url, opts, _ = s3_corpus
    monkeypatch.setitem(sys.modules, "obstore", None)  # ``import obstore`` raises ImportError
    assert _kind(url, opts, "auto") == "S3HttpReader"
    with pytest.raises(ConfigError, match="client='obstore' cannot be used: obstore is not installed"):
        open_url(url, opts, RetryPolicy(), "obstore")
    # options the HTTP reader cannot honour: auto takes s3fs, "http" says why
    assert _kind(url, {**opts, "profile": "dev"}, "auto") == "S3FileSystem"
    with pytest.raises(ConfigError, match=r"client='http' cannot be used: storage_options \['profile'\]"):
        open_url(url, {**opts, "profile": "dev"}, RetryPolicy(), "http")


# -- an S3 server that checks signatures -------------------------------------------------------
_SETUP_ACTIONS = 3  # create the user, its key and its policy before the server checks anything

_SERVER = """
import sys, time
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()  # until the test closes our stdin
server.stop()
"""


@pytest.fixture(scope="module")
def signed_s3():
    """A moto server that authenticates every request past its first three (IAM signature
    checks), a user allowed all of S3, and ``(endpoint, key, secret)``."""
    pytest.importorskip("boto3")
    import boto3

    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(_SETUP_ACTIONS)}
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        endpoint = f"http://127.0.0.1:{port}"
        iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1",
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="reader")
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        iam.put_user_policy(UserName="reader", PolicyName="all-s3", PolicyDocument=(
            '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'))
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_signatures_pass_a_server_that_checks_them(signed_s3, docs):
    endpoint, key, secret = signed_s3
    opts = {"key": key, "secret": secret, "client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
    import s3fs

    bucket = f"signed-{os.getpid()}-{time.monotonic_ns()}"
    s3fs.S3FileSystem(**opts).mkdir(bucket)
    url = f"s3://{bucket}/web corpus/ü~x"  # a key that must be percent-encoded the way it is signed
    write_corpus(url, docs[:40], opts)
    source = ShardSource.open(url, opts, config(client="http"))
    assert same(tokens_of(read_all(source)), docs[:40])
    assert source.stats()["http_requests"] == source.stats()["requests"] > 0
    source.close()

    wrong = {**opts, "secret": secret[:-1] + ("x" if secret[-1] != "x" else "y")}
    with pytest.raises(ManifestError, match=r"access denied .* HTTP 403 SignatureDoesNotMatch"):
        ShardSource.open(url, wrong, config(client="http"))  # refused at once, not retried
    # the control: s3fs signing with the wrong secret is refused by the same server
    with pytest.raises(PermissionError):
        s3fs.S3FileSystem(**wrong).cat_file(f"{bucket}/web corpus/ü~x/index.json")


def test_threads_racing_for_a_new_pool_all_sign_their_requests(s3_corpus):
    """A reader's pool and signer are built by the first request in each process; fetch
    threads that make their first requests together must each find both (an unsigned
    request is refused)."""
    import threading

    url, opts, _ = s3_corpus
    settings = objstore.obstore_settings(opts)[0]
    for _ in range(10):
        reader = S3HttpReader(settings, RetryPolicy())
        path = f"{S3HttpReader._strip_protocol(url)}/index.json"
        start, errors = threading.Barrier(8), []

        def first_request():
            start.wait()
            try:
                reader.cat_file(path, 0, 16)
            except Exception as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=first_request) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []


class _ForwardProxy:
    """A plain-HTTP forward proxy on 127.0.0.1: requests come with absolute URLs, are sent on
    to their host, and counted (``seen``)."""

    def __init__(self) -> None:
        import http.client
        import http.server
        import threading

        outer = self
        self.seen: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self):
                outer.seen.append(f"{self.command} {self.path}")
                target = urlsplit(self.path)
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=10)
                path = target.path + (f"?{target.query}" if target.query else "")
                conn.request(self.command, path, headers={k: v for k, v in self.headers.items()
                                                          if k.lower() not in ("proxy-connection", "connection")})
                answer = conn.getresponse()
                body = answer.read()
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding"):
                        self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
                conn.close()

            do_GET = do_HEAD = _forward

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_requests_go_through_the_proxy_the_environment_names(s3_corpus, docs, monkeypatch):
    url, opts, _ = s3_corpus
    proxy = _ForwardProxy()
    try:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        # a reader decides its route on its first request to a host: a policy no other test
        # uses gives this one a reader of its own
        fresh = RetryPolicy(attempts=3, backoff_base=0.01, timeout=9.5)
        source = ShardSource.open(url, opts, config(client="http", prefetch_bytes=0, retry=fresh))
        assert same(tokens_of(read_all(source, plan=False)), docs)
        assert len(proxy.seen) == source.stats()["requests"] + 1 > 1  # the manifest, then every read
        assert all(line.split()[1].startswith(opts["client_kwargs"]["endpoint_url"]) for line in proxy.seen)
        source.close()
        # NO_PROXY names the endpoint's host: straight to it
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        before = len(proxy.seen)
        direct = S3HttpReader(objstore.obstore_settings(opts)[0], RetryPolicy())
        assert len(direct.cat_file(f"{S3HttpReader._strip_protocol(url)}/index.json")) > 0
        assert len(proxy.seen) == before
    finally:
        proxy.stop()

"""The parent's side of a run: each system's copy of the corpus, the cases of one corpus size
(ceilings, systems x storage x workers, interleaved within each repeat), and resume from states
saved at 10%, 50% and 90% of an uninterrupted pass."""

from __future__ import annotations

import importlib.metadata
import os
import shutil

from .corpus import dir_bytes, save_meta
from .harness import ChildFailed, run_case, run_child
from .loaders_grain import S3_REASON as GRAIN_S3_REASON
from .settings import BUCKET, CEILINGS, CREDS, EQUAL, PACKAGES, POSITIONS, ROOT
from .workarounds import litdata_index_mismatch


def package_versions() -> dict[str, str]:
    out = {}
    for name in ("streamforge", "torch", "torchvision", "numpy", "zstandard", "grain", "array-record", "litdata", "obstore",
                 "mosaicml-streaming", "webdataset", "torchdata", "moto", "psutil"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def missing_package(system: str) -> str | None:
    package = PACKAGES.get(system)
    if package is None:
        return None
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return f"`{package}` is not installed (`make venv-bench`)"
    extra = {"webdataset": "torchdata", "grain": "array-record"}.get(system)
    if extra:
        try:
            importlib.metadata.version(extra)
        except importlib.metadata.PackageNotFoundError:
            return f"`{extra}` is not installed (`make venv-bench`)"
    return None


def ensure_formats(meta: dict, systems: list[str], timeout: float) -> None:
    """Each system's copy of the corpus, written by its own writer in a fresh process; a
    writer that fails leaves its reason in ``meta["formats"]``."""
    for system in systems:
        have = meta["formats"].get(system)
        if have and "error" not in have:
            continue
        reason = missing_package(system)
        if reason:
            meta["formats"][system] = {"error": reason}
            continue
        out = os.path.join(meta["root"], "fmt", system)
        shutil.rmtree(out, ignore_errors=True)
        print(f"  writing the {system} format ...", flush=True)
        try:
            got = run_child({"kind": "write", "system": system, "meta": meta, "out": out}, timeout)
            size, files = dir_bytes(out)
            meta["formats"][system] = {"dir": out, "bytes": size, "files": files, "write_s": got["seconds"]}
        except ChildFailed as e:
            meta["formats"][system] = {"error": f"writer failed: {e}"}
        save_meta(meta)


class Storage:
    """The S3 side of a run: moto in a child process (``LoopbackS3(in_process=False)``) and, in
    another child, the proxies the loaders read it through (``latency_proxy.ProxyProcess``):
    ``s3`` adds nothing and counts, ``s3-latency`` adds the time to first byte and the
    per-connection cap. Uploads go to moto directly; each case's requests and bytes are counted
    at its proxy."""

    def __init__(self, latency_ms: float, bandwidth_mbps: float) -> None:
        from streamforge.demo.s3 import LoopbackS3

        from .latency_proxy import ProxyProcess

        self.server = LoopbackS3(key=CREDS["AWS_ACCESS_KEY_ID"], secret=CREDS["AWS_SECRET_ACCESS_KEY"],
                                 in_process=False).start()
        try:
            self.proxies = ProxyProcess(self.server.endpoint_url, [(0, 0), (latency_ms, bandwidth_mbps)])
        except BaseException:
            self.server.stop()
            raise
        self.endpoints = dict(zip(("s3", "s3-latency"), self.proxies.endpoints))

    def upload(self, local: str, prefix: str) -> None:
        self.server.upload(local, BUCKET, prefix)

    def stop(self) -> None:
        try:
            self.proxies.stop()
        finally:
            self.server.stop()


def location(meta: dict, system: str, backend: str) -> str:
    if system in ("memmap", "contract"):
        return meta["flat"]
    if system in ("zstd", EQUAL):  # streamforge's shards
        system = "streamforge"
    if backend == "local":
        return meta["formats"][system]["dir"]
    return f"s3://{BUCKET}/{os.path.basename(meta['root'])}/{system}"


def case_spec(meta: dict, system: str, workers: int, backend: str, storage: Storage | None, cache: str) -> dict:
    spec = {"kind": "pass", "system": system, "workers": workers, "location": location(meta, system, backend),
            "cache": cache, "tokens": meta["flat_tokens"], "starts": meta["starts"]}
    if backend != "local":
        spec["s3"] = {"endpoint": storage.endpoints[backend], "listing": meta["formats"][system]["dir"]}
    return spec


def run_counted(spec: dict, backend: str, storage: Storage | None, timeout: float) -> dict:
    """A case; from S3, with the requests and body bytes its proxy saw (``requests``, ``gets``,
    ``read_bytes``)."""
    if backend == "local":
        return run_case(spec, timeout)
    endpoint = storage.endpoints[backend]
    storage.proxies.reset(endpoint)
    out = run_case(spec, timeout)
    counts = storage.proxies.counts(endpoint)
    if not counts["gets"]:  # every cache is fresh: a pass that read S3 read it through the proxy
        raise ChildFailed(f"no GET reached the proxy at {endpoint}: the loader read S3 some other way")
    out.update(requests=counts["requests"], gets=counts["gets"], read_bytes=counts["bytes"])
    return out


def not_runnable(case: tuple, meta: dict) -> str | None:
    """Why a case cannot run at all here (known before it runs), or None."""
    system, _, backend = case
    if backend == "local":
        return None
    if system == "grain":
        return GRAIN_S3_REASON
    if system.startswith("litdata"):
        return litdata_index_mismatch(meta["formats"][system]["dir"])
    return None


def systems_at(args, tokens: int) -> list[str]:
    """The systems measured at a corpus size: all at the main (smallest) one, ``--large-systems``
    at larger ones."""
    if tokens == min(args.tokens) or args.large_systems is None:
        return list(args.systems)
    return [s for s in args.systems if s in args.large_systems]


def measure_size(size: int, meta: dict, args, storage: Storage | None) -> dict:
    """Throughput cases (interleaved per repeat) and, at the main size, resume for one corpus size."""
    from tqdm import tqdm

    ok = [s for s in systems_at(args, size) if "error" not in meta["formats"].get(s, {"error": "not written"})]
    cases = [(c, 0, "local") for c in CEILINGS if "streamforge" in ok]
    cases += [(s, w, b) for s in ok for b in args.backends for w in args.workers]
    if "streamforge" in ok and "local" in args.backends and 0 in args.workers:
        cases.insert(cases.index(("streamforge", 0, "local")) + 1, (EQUAL, 0, "local"))
    cache = os.path.join(ROOT, "bench-out", "peers", "cache", "run")
    runs: dict = {c: [] for c in cases}
    errors: dict = {}
    with tqdm(total=args.repeats * len(cases), desc=f"passes t{meta['tokens']:.0e}", leave=False) as bar:
        for _ in range(args.repeats):
            for case in cases:
                bar.set_postfix_str("/".join(map(str, case)))
                if case not in errors:
                    reason = not_runnable(case, meta)
                    if reason:
                        errors[case] = reason
                if case not in errors:
                    try:
                        runs[case].append(run_counted(case_spec(meta, *case, storage, cache), case[2], storage,
                                                      args.timeout))
                    except ChildFailed as e:
                        errors[case] = str(e)
                bar.update()
    # resume: on the main corpus only (positions scale with it)
    resume = {} if args.no_resume or size > min(args.tokens) else measure_resume(meta, args, ok, runs, errors)
    return {"runs": runs, "errors": errors, "resume": resume}


def measure_sizes(metas: dict, args) -> dict:
    """{size: results} for each corpus size; the S3 cases read a loopback S3 server (moto in a
    child process, so its CPU and memory are not the case's) holding each system's copy, through
    a proxy in another child (``Storage``)."""
    storage = None
    if any(b != "local" for b in args.backends):
        storage = Storage(args.latency_ms, args.bandwidth_mbps)
    results = {}
    try:
        for tokens, meta in metas.items():
            if storage:
                for system in systems_at(args, tokens):
                    if "error" not in meta["formats"][system] and system != "grain":
                        storage.upload(meta["formats"][system]["dir"], f"{os.path.basename(meta['root'])}/{system}")
            results[tokens] = measure_size(tokens, meta, args, storage)
    finally:
        if storage:
            storage.stop()
    return results


def measure_resume(meta: dict, args, systems: list[str], runs: dict, errors: dict) -> dict:
    from tqdm import tqdm

    w = args.resume_workers
    out = {}
    cache = os.path.join(ROOT, "bench-out", "peers", "cache", "resume")
    for system in tqdm(systems, desc="resume", leave=False):
        key = (system, w, "local")
        if not runs.get(key):
            out[system] = {"error": errors.get(key, "no uninterrupted pass to resume in")}
            continue
        n = runs[key][0]["batches"]
        at = sorted({max(1, min(n - 1, round(f * n))) for f in POSITIONS})
        cdir = os.path.join(meta["root"], "resume", system)
        shutil.rmtree(cdir, ignore_errors=True)
        os.makedirs(cdir)
        spec = case_spec(meta, system, w, "local", None, cache)
        try:
            got = run_case({**spec, "capture": {"dir": cdir, "at": at}}, args.timeout)
        except ChildFailed as e:
            out[system] = {"error": f"capture pass failed: {e}"}
            continue
        res = {"batches": got["batches"], "at": at, "times": {b: [] for b in at}, "exact": {b: [] for b in at},
               "checked": {b: [] for b in at}, "errors": {}}
        for _ in range(args.repeats):
            for b in at:
                if b in res["errors"]:
                    continue
                rspec = {**spec, "kind": "resume", "state": os.path.join(cdir, f"state-{b}.pkl"),
                         "digests": os.path.join(cdir, "digests.json"), "batch": b, "check": args.resume_check}
                try:
                    r = run_case(rspec, args.timeout)
                except ChildFailed as e:
                    res["errors"][b] = str(e)
                    continue
                res["times"][b].append(r["seconds"])
                res["exact"][b].append(r["exact"])
                res["checked"][b].append(r["checked"])
        out[system] = res
    return out


# ================================================================================================

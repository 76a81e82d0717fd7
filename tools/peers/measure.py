"""The parent's side of a run: each system's copy of the corpus, the cases of one corpus size
(ceilings, systems x storage x workers, interleaved within each repeat), and resume from states
saved at 10%, 50% and 90% of an uninterrupted pass."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from typing import TYPE_CHECKING

from .corpus import dir_bytes, save_meta
from .harness import ChildFailed, run_case, run_child
from .settings import BUCKET, CEILINGS, CREDS, EQUAL, PACKAGES, POSITIONS, ROOT
from .workarounds import litdata_index_mismatch

if TYPE_CHECKING:
    from streamforge.demo.s3 import LoopbackS3


def package_versions() -> dict[str, str]:
    out = {}
    for name in ("streamforge", "torch", "numpy", "zstandard", "litdata", "obstore", "mosaicml-streaming",
                 "webdataset", "torchdata", "moto", "psutil"):
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
    if system == "webdataset":
        try:
            importlib.metadata.version("torchdata")
        except importlib.metadata.PackageNotFoundError:
            return "`torchdata` is not installed (`make venv-bench`)"
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


def location(meta: dict, system: str, backend: str, s3: LoopbackS3 | None) -> str:
    if system in ("memmap", "contract"):
        return meta["flat"]
    if system in ("zstd", EQUAL):  # streamforge's shards
        system = "streamforge"
    if backend == "local":
        return meta["formats"][system]["dir"]
    return f"s3://{BUCKET}/{os.path.basename(meta['root'])}/{system}"


def case_spec(meta: dict, system: str, workers: int, backend: str, s3: LoopbackS3 | None, cache: str) -> dict:
    spec = {"kind": "pass", "system": system, "workers": workers, "location": location(meta, system, backend, s3),
            "cache": cache, "tokens": meta["flat_tokens"], "starts": meta["starts"]}
    if backend == "s3":
        spec["s3"] = {"endpoint": s3.endpoint_url, "listing": meta["formats"][system]["dir"]}
    return spec


def systems_at(args, tokens: int) -> list[str]:
    """The systems measured at a corpus size: all at the main (smallest) one, ``--large-systems``
    at larger ones."""
    if tokens == min(args.tokens) or args.large_systems is None:
        return list(args.systems)
    return [s for s in args.systems if s in args.large_systems]


def measure_size(size: int, meta: dict, args, s3: LoopbackS3 | None) -> dict:
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
                if case not in errors and case[2] == "s3" and case[0].startswith("litdata"):
                    reason = litdata_index_mismatch(meta["formats"][case[0]]["dir"])
                    if reason:
                        errors[case] = reason
                if case not in errors:
                    try:
                        runs[case].append(run_case(case_spec(meta, *case, s3, cache), args.timeout))
                    except ChildFailed as e:
                        errors[case] = str(e)
                bar.update()
    # resume: on the main corpus only (positions scale with it)
    resume = {} if args.no_resume or size > min(args.tokens) else measure_resume(meta, args, ok, runs, errors, s3)
    return {"runs": runs, "errors": errors, "resume": resume}


def measure_sizes(metas: dict, args) -> dict:
    """{size: results} for each corpus size; the S3 cases read a loopback S3 server (moto in a
    child process, so its CPU and memory are not the case's) holding each system's copy."""
    s3 = None
    if "s3" in args.backends:
        from streamforge.demo.s3 import LoopbackS3

        s3 = LoopbackS3(key=CREDS["AWS_ACCESS_KEY_ID"], secret=CREDS["AWS_SECRET_ACCESS_KEY"], in_process=False).start()
    results = {}
    try:
        for tokens, meta in metas.items():
            if s3:
                for system in systems_at(args, tokens):
                    if "error" not in meta["formats"][system]:
                        s3.upload(meta["formats"][system]["dir"], BUCKET, f"{os.path.basename(meta['root'])}/{system}")
            results[tokens] = measure_size(tokens, meta, args, s3)
    finally:
        if s3:
            s3.stop()
    return results


def measure_resume(meta: dict, args, systems: list[str], runs: dict, errors: dict, s3) -> dict:
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
        spec = case_spec(meta, system, w, "local", s3, cache)
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

"""The ``streamforge`` command: convert, inspect, verify, plan, ledger, demo.

``main(argv)`` returns the exit code, so tests call it directly. ``plan`` and ``demo`` import
their modules only when used.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import numpy as np

from .errors import StreamforgeError

_HIST_WIDTH = 40


def storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """Storage options from ``--endpoint-url`` and repeated ``--storage-option KEY=VALUE``."""
    opts: dict[str, Any] = {}
    for item in args.storage_option or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--storage-option expects KEY=VALUE, got {item!r}")
        opts[key] = _scalar(value)
    if args.endpoint_url:
        opts.setdefault("client_kwargs", {})["endpoint_url"] = args.endpoint_url
    return opts or None


def _scalar(value: str) -> Any:
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(value)
    except ValueError:
        return value


def _add_storage_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint, e.g. http://127.0.0.1:9000")
    parser.add_argument(
        "--storage-option", action="append", metavar="KEY=VALUE", help="fsspec option (repeatable)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamforge", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    conv = sub.add_parser("convert", help="convert a token corpus into a stream")
    conv.add_argument("--from", dest="fmt", required=True,
                      choices=["megatron", "flat", "npy", "jsonl", "parquet"])
    conv.add_argument("--input", required=True, help="source path (Megatron: prefix, .bin or .idx)")
    conv.add_argument("--output", required=True, help="output URL (local path, s3://...)")
    conv.add_argument("--shard-size", default="64MiB")
    conv.add_argument("--frame-size", default="256KiB")
    conv.add_argument("--compression-level", type=int, default=3)
    conv.add_argument("--compression", choices=("zstd", "none"), default="zstd",
                      help="frame codec: zstd (.tar.zst shards) or none (plain .tar shards)")
    conv.add_argument("--workers", type=int, default=1)
    conv.add_argument("--eos-id", type=int)
    conv.add_argument(
        "--docs-end-with-eos", choices=("auto", "yes", "no"), default="auto",
        help="do documents already end with --eos-id? auto (default): yes if every non-empty "
             "document does, no if none does, an error for a mix; yes: append EOS at conversion "
             "where missing; no: the pipeline appends EOS to every document",
    )
    conv.add_argument("--dtype", help="source dtype of raw token files (flat default uint16)")
    conv.add_argument("--token-dtype", choices=["uint16", "uint32"],
                      help="force the shards' token dtype (default: smallest that fits)")
    conv.add_argument("--field", default="input_ids", help="jsonl/parquet token field")
    conv.add_argument("--offsets", help="npy: document offsets array (.npy)")
    conv.add_argument("--vocab-size", type=int)
    conv.add_argument("--limit", type=int, help="convert only the first N documents")
    conv.add_argument("--overwrite", action="store_true",
                      help="replace what the output prefix holds; unlisted shards are removed")
    text = conv.add_argument_group("raw text (jsonl/parquet): tokenize --text-field with --tokenizer")
    text.add_argument("--text-field", help="the field/column holding each document's text")
    text.add_argument("--tokenizer", help="tokenizer.json, tiktoken BPE file or sentencepiece .model")
    text.add_argument("--tokenizer-kind", choices=("hf", "tiktoken", "sentencepiece"),
                      help="default: from the file name (.json, .tiktoken/.bpe, .model)")
    text.add_argument("--tiktoken-pattern", help="tiktoken: the split pattern (regex)")
    text.add_argument("--eos-token", help="name of the EOS token (default: the tokenizer's own)")
    text.add_argument("--on-bad-row", choices=("raise", "skip"), default="raise",
                      help="a row with no text field, a non-string or invalid UTF-8: stop, or skip it "
                           "(skipped rows are counted and listed in the manifest)")
    text.add_argument("--engine", choices=("local", "ray"), default="local",
                      help="local: --workers processes; ray: a Ray cluster")
    text.add_argument("--ray-address", help="Ray cluster to join (default: RAY_ADDRESS, else a local one)")
    _add_storage_args(conv)

    for name, text in (("inspect", "summarize a stream"), ("verify", "check every shard")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("url")
        _add_storage_args(cmd)

    plan = sub.add_parser("plan", help="show which records each global worker reads")
    plan.add_argument("urls", nargs="+")
    plan.add_argument("--world-size", type=int, required=True)
    plan.add_argument("--workers", type=int, required=True)
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--pass", dest="pass_idx", type=int, default=0)
    _add_storage_args(plan)

    _add_ledger_parser(sub)
    sub.add_parser("demo", help="run the demo (options pass through)", add_help=False)
    return parser


def _add_ledger_parser(sub) -> None:
    ledger = sub.add_parser("ledger", help="check, compare or show a data-order ledger (docs/ledger.md)")
    cmds = ledger.add_subparsers(dest="ledger_command", required=True)
    check = cmds.add_parser("check", help="prove no token was delivered twice; list what was skipped or never reached")
    check.add_argument("url", help="the ledger_dir (local path or URL)")
    check.add_argument("--no-manifests", action="store_true",
                       help="do not read the streams' manifests (no count of records never reached)")
    diff = cmds.add_parser("diff", help="where two runs' data orders first diverge")
    diff.add_argument("url_a")
    diff.add_argument("url_b")
    show = cmds.add_parser("show", help="what was in one step, per rank and row")
    show.add_argument("url")
    show.add_argument("--step", type=int, required=True)
    for cmd in (check, diff, show):
        cmd.add_argument("--json", action="store_true", help="print the report as JSON")
        _add_storage_args(cmd)


def cmd_convert(args: argparse.Namespace) -> int:
    import time

    from .convert import convert

    start = time.perf_counter()
    text = {}
    if args.text_field or args.tokenizer:
        text = dict(text_field=args.text_field, tokenizer=args.tokenizer,
                    tokenizer_kind=args.tokenizer_kind, tiktoken_pattern=args.tiktoken_pattern,
                    eos_token=args.eos_token, on_bad_row=args.on_bad_row, engine=args.engine,
                    ray_address=args.ray_address)
    elif args.engine != "local":
        text = dict(engine=args.engine)
    manifest = convert(
        args.fmt,
        args.input,
        args.output,
        shard_size=args.shard_size,
        workers=args.workers,
        eos_id=args.eos_id,
        dtype=args.dtype,
        token_dtype=args.token_dtype,
        field=None if text else args.field,
        limit=args.limit,
        vocab_size=args.vocab_size,
        offsets=args.offsets,
        docs_end_with_eos=args.docs_end_with_eos,
        storage_options=storage_options(args),
        overwrite=args.overwrite,
        frame_size=args.frame_size,
        compression_level=args.compression_level,
        compression=args.compression,
        **text,
    )
    print(
        f"{args.output}: {manifest.num_shards} shards, {manifest.num_records:,} records, "
        f"{manifest.num_tokens:,} tokens ({manifest.token_dtype}), {manifest.num_bytes:,} bytes"
    )
    print(f"documents end with EOS: {describe_eos(manifest)}")
    if manifest.tokenizer:
        print(f"tokenizer: {describe_tokenizer(manifest.tokenizer)}")
        skipped = manifest.conversion.get("skipped_rows", {})
        print(f"skipped rows: {skipped.get('count', 0):,}")
        for line in skipped.get("listed", [])[:10]:
            print(f"  {line}")
        print(f"time: {time.perf_counter() - start:.1f} s")
    return 0


def describe_tokenizer(record: dict[str, Any]) -> str:
    return (f"{record.get('kind')} {record.get('name')} (sha256 {str(record.get('sha256'))[:16]}..., "
            f"vocab {record.get('vocab_size'):,}, EOS id {record.get('eos_id')})")


def length_histogram(lengths: np.ndarray) -> list[str]:
    """Text histogram of document lengths in log2 buckets: 0, 1, 2-3, 4-7, ..."""
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets = np.zeros(len(lengths), np.int64)
    positive = lengths > 0
    buckets[positive] = np.floor(np.log2(lengths[positive])).astype(np.int64) + 1
    counts = np.bincount(buckets) if len(buckets) else np.zeros(1, np.int64)
    top = max(int(counts.max()), 1)
    lines = []
    for b, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        lo, hi = (0, 0) if b == 0 else (1 << (b - 1), (1 << b) - 1)
        bar = "#" * max(1, round(_HIST_WIDTH * count / top))
        lines.append(f"  {lo:>9,}-{hi:<9,} {count:>10,}  {bar}")
    return lines


def describe_eos(manifest) -> str:
    from .convert.eos import describe

    return describe(manifest)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .source import ShardSource

    source = ShardSource.open(args.url, storage_options(args))
    manifest = source.manifest
    raw_bytes = 0
    lengths = []
    for shard in range(manifest.num_shards):
        index = source.index(shard)
        raw_bytes += int(index.frames["raw_size"].astype(np.int64).sum())
        lengths.append(index.records["num_tokens"].astype(np.int64))
    lengths_all = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    ratio = raw_bytes / manifest.num_bytes if manifest.num_bytes else float("nan")
    print(f"stream       {args.url}")
    print(f"shards       {manifest.num_shards:,}")
    print(f"records      {manifest.num_records:,}")
    print(f"tokens       {manifest.num_tokens:,}")
    print(f"bytes        {manifest.num_bytes:,} compressed, {raw_bytes:,} tar")
    print(f"compression  {ratio:.2f}x")
    print(f"token dtype  {manifest.token_dtype}")
    print(f"eos id       {manifest.eos_id}")
    print(f"documents end with EOS: {describe_eos(manifest)}")
    print(f"vocab size   {manifest.vocab_size}")
    if manifest.tokenizer:
        print(f"tokenizer    {describe_tokenizer(manifest.tokenizer)}")
    if len(lengths_all):
        print(
            f"doc length   mean {lengths_all.mean():,.1f}, median {np.median(lengths_all):,.0f}, "
            f"max {lengths_all.max():,}"
        )
        print("length histogram (tokens: documents)")
        print("\n".join(length_histogram(lengths_all)))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .format.manifest import Manifest
    from .format.verify import verify_stream

    opts = storage_options(args)
    problems = verify_stream(args.url, opts)
    if problems:
        for problem in problems:
            print(f"BAD {problem}", file=sys.stderr)
        print(f"{args.url}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    manifest = Manifest.load(args.url, opts)
    print(
        f"OK {args.url}: {manifest.num_shards} shards, {manifest.num_records:,} records, "
        f"{manifest.num_tokens:,} tokens verified"
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .planning.planner import format_plan

    print(
        format_plan(
            args.urls,
            world_size=args.world_size,
            workers=args.workers,
            seed=args.seed,
            pass_idx=args.pass_idx,
            storage_options=storage_options(args),
        )
    )
    return 0


def cmd_ledger(args: argparse.Namespace) -> int:
    import json

    from .ledger.store import read_ledger
    from .ledger.report import check, diff, show
    from .ledger.text import format_check, format_diff, format_show

    opts = storage_options(args)
    if args.ledger_command == "check":
        ledger = read_ledger(args.url, opts)
        report = check(ledger, None if args.no_manifests else _ledger_manifests(ledger, opts))
        print(json.dumps(report, indent=1) if args.json else format_check(report, args.url))
        return 0 if report["ok"] else 1
    if args.ledger_command == "diff":
        report = diff(read_ledger(args.url_a, opts), read_ledger(args.url_b, opts))
        print(json.dumps(report, indent=1) if args.json else format_diff(report, args.url_a, args.url_b))
        return 0 if report["identical"] else 1
    report = show(read_ledger(args.url, opts), args.step)
    print(json.dumps(report, indent=1) if args.json else format_show(report))
    return 0 if report["ranks"] else 1


def _ledger_manifests(ledger, opts) -> dict[str, Any]:
    """The manifests of the ledger's streams that can be read and match the recorded
    fingerprint; the others are left out (and reported as not read)."""
    from .format.manifest import Manifest

    out = {}
    meta = ledger.meta
    for stream, url in zip(meta.get("streams", []), meta.get("stream_urls", [])):
        try:
            manifest = Manifest.load(url, opts)
        except (OSError, StreamforgeError) as exc:
            print(f"streamforge ledger: cannot read the manifest of {stream['name']} at {url}: {exc}", file=sys.stderr)
            continue
        if manifest.fingerprint != stream.get("manifest"):
            print(f"streamforge ledger: {url} has changed since the run (manifest fingerprint "
                  f"{manifest.fingerprint}, recorded {stream.get('manifest')}): not used", file=sys.stderr)
            continue
        out[stream["name"]] = manifest
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from .demo.run import main as demo_main

        return demo_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    handlers = {"convert": cmd_convert, "inspect": cmd_inspect, "verify": cmd_verify, "plan": cmd_plan,
                "ledger": cmd_ledger}
    try:
        return handlers[args.command](args)
    except StreamforgeError as exc:
        print(f"streamforge {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Operator CLI: `python -m checkpointing list|verify|gc URL`.

Works on any storage URL from any machine; credentials and endpoint from the standard AWS_*
variables (or --option key=value). Exit codes: 0 fine, 1 a corrupt checkpoint was found
(verify), 2 usage or storage error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

from checkpointing import manifest as mf
from checkpointing import retention
from checkpointing.errors import CheckpointError
from checkpointing.storage import Storage


def _option_value(text: str):
    """An --option value as the fsspec option it means: true/false (any case) are bools,
    none/null is None, integers and decimals are numbers, `{...}`/`[...]` is JSON (e.g.
    client_kwargs={"region_name": "eu-west-1"}); anything else stays a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    digits = text.strip().lstrip("+-")
    if len(digits) > 1 and digits.startswith("0") and digits[1:2].isdigit():
        return text  # "007", an id or key with leading zeros: keep it as written
    for parse in (int, float):
        try:
            value = parse(text)
        except ValueError:
            continue
        if parse is float and value != value or value in (float("inf"), float("-inf")):
            break  # "nan"/"inf" are strings here, not numbers
        return value
    if text.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(text)
        except ValueError as e:
            raise SystemExit(f"--option value {text!r} looks like JSON but does not parse: {e}") from e
    return text


def _options(pairs: list[str]) -> dict:
    opts = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--option expects KEY=VALUE, got {pair!r}")
        opts[key] = _option_value(value)
    return opts


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def cmd_list(storage: Storage, args) -> int:
    committed = {c.step: c for c in mf.list_committed(storage)}
    rows: list[dict[str, Any]] = []
    for step in mf.list_steps(storage):
        c = committed.get(step)
        rows.append({"step": step, "committed": c is not None,
                     "generation": c.generation if c else None,
                     "world_size": c.world_size if c else None,
                     "files": len(c.files) if c else None,
                     "bytes": c.total_bytes if c else None,
                     "committed_at": c.committed_at if c else None})
    fence = mf.read_fence(storage)
    if args.json:
        print(json.dumps({"url": storage.display_url, "fence": fence, "checkpoints": rows}))
        return 0
    print(f"{storage.display_url}  (FENCE generation: {fence if fence is not None else 'none'})")
    if not rows:
        print("  no checkpoints")
    for r in rows:
        if r["committed"]:
            print(f"  step {r['step']:>10}  committed  gen {r['generation']:<4} world {r['world_size']:<4}"
                  f" {r['files']:>4} files {r['bytes'] / 1e6:>10.1f} MB  {_when(r['committed_at'])}")
        else:
            print(f"  step {r['step']:>10}  UNCOMMITTED (not a checkpoint; `gc` removes it)")
    return 0


def cmd_verify(storage: Storage, args) -> int:
    committed = mf.list_committed(storage)
    if args.step is not None:
        committed = [c for c in committed if c.step == args.step]
        if not committed:
            print(f"no committed checkpoint at step {args.step} under {storage.display_url}", file=sys.stderr)
            return 2
    corrupt = 0
    results = []
    for c in committed:
        bad = mf.verify_files(storage, c.step, c.files)
        corrupt += bool(bad)
        results.append({"step": c.step, "ok": not bad, "problems": bad})
        if not args.json:
            status = "OK" if not bad else "CORRUPT"
            print(f"step {c.step:>10}  {status:<8} {len(c.files)} files, {c.total_bytes / 1e6:.1f} MB  "
                  f"{storage.display(c.path)}")
            for b in bad:
                print(f"    {b['file']}: {b['reason']}")
    if args.json:
        print(json.dumps({"url": storage.display_url, "checkpoints": results}))
    elif not committed:
        print(f"no committed checkpoints under {storage.display_url}")
    elif corrupt:
        print(f"{corrupt} of {len(committed)} committed checkpoints are corrupt; loading falls back "
              f"to the newest one that verifies")
    return 1 if corrupt else 0


def cmd_gc(storage: Storage, args) -> int:
    report = retention.collect(storage, keep=args.keep, dry_run=args.dry_run,
                               protect_newer_uncommitted=not args.include_newer,
                               verify=not args.no_verify)
    report["deleted"] = [storage.display(path) for path in report["deleted"]]
    if args.json:
        print(json.dumps({"url": storage.display_url, "dry_run": args.dry_run, **report}))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for path in report["deleted"]:
        print(f"{verb} {path}")
    print(f"{verb} {len(report['deleted'])} paths; committed steps kept: {report['kept']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m checkpointing", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("list", "list step directories and their commit state"),
                           ("verify", "recheck sizes and sha256 of committed checkpoints"),
                           ("gc", "delete uncommitted step directories and old checkpoints")):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("url", help="storage URL (the run's --storage; checkpoints/ is below it)")
        sp.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option, e.g. endpoint_url=http://127.0.0.1:9000 or "
                             "anon=true (true/false, numbers and JSON values are parsed)")
        sp.add_argument("--json", action="store_true", help="one JSON document on stdout")
        if name == "verify":
            sp.add_argument("--step", type=int, help="only this step")
        if name == "gc":
            sp.add_argument("--keep", type=int, default=None,
                            help="keep the newest N committed checkpoints (default: keep all)")
            sp.add_argument("--dry-run", action="store_true", help="print what would be deleted")
            sp.add_argument("--no-verify", action="store_true",
                            help="do not recheck checksums (by default the newest checkpoint "
                                 "that verifies is always kept)")
            sp.add_argument("--include-newer", action="store_true",
                            help="also delete uncommitted steps newer than the newest committed "
                                 "one (only when no run is writing to URL)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "keep", None) is not None and args.keep < 1:
        print("--keep must be >= 1", file=sys.stderr)
        return 2
    try:
        storage = Storage(args.url, _options(args.option))
        return {"list": cmd_list, "verify": cmd_verify, "gc": cmd_gc}[args.command](storage, args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

"""The operator CLI, `elastic` (or `python -m elastic`): look at a run from outside.

    elastic status URL [--watch] [--json]   live view of <URL>/status.json; exit 0, 1 when the
                                   run failed, 2 no run there or a storage error, 3 a live state
                                   not updated for 60 s (the run is probably dead)
    elastic report URL [--json] [--plot [PATH]]   the summary and the recoveries table of a
                                   finished run; exit 0 finished, 1 otherwise, 2 no summary or a
                                   storage error; --plot draws loss, world size and LR over time
                                   and the time ledger as a stacked bar (default PATH:
                                   <URL>/report.png)
                                   (status and report take --option KEY=VALUE: fsspec storage
                                   options; credentials and endpoint also come from AWS_*)
    elastic stop URL [--reason TEXT]   ask the live run to commit a checkpoint at its next step
                                   and end with status "stopped" (resumable); exit 0 asked,
                                   1 the run has already ended, 2 no run there or a storage error
                                   (status, report and stop take --option KEY=VALUE)
    elastic ckpt list|verify|gc URL   committed checkpoints (same as `python -m checkpointing`)
    elastic export URL [--step N] --out FILE   the model weights of a committed checkpoint as one
                                   file that plain `torch.load(FILE, weights_only=True)` reads;
                                   --format hf [--config FILE] [--module NAME]: a directory that
                                   transformers' from_pretrained reads (model.safetensors, config.json)
    elastic chaos run|list|schedule|heal ...   fault injection (same as `python -m chaos`)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from checkpointing.errors import StorageError
from checkpointing.storage import Storage
from elastic._credentials import mask_url


class _Unreadable(Exception):
    """A run file that is there but is no JSON object: exit 2 with its name."""


def _read_json(url: str, name: str, options: dict | None = None) -> dict | None:
    """`name` under the run's storage as a dict, None when it does not exist; a StorageError
    (unreachable store, bad credentials, unknown scheme) passes up to main (exit 2)."""
    storage = Storage(url, options)
    try:
        payload = json.loads(storage.read_bytes(storage.path(name)))
    except FileNotFoundError:
        return None
    except ValueError as error:
        raise _Unreadable(f"{name} under {mask_url(url)} is not valid JSON ({error})") from None
    if not isinstance(payload, dict):
        raise _Unreadable(f"{name} under {mask_url(url)} is not a JSON object")
    return payload


def _parse_options(pairs: list[str]) -> dict:
    """--option KEY=VALUE pairs as fsspec options, typed as every CLI of the project types them
    (checkpointing.cli: `anon=false` is False, JSON objects parse); a malformed one is _Unreadable."""
    from checkpointing.cli import _options
    try:
        return _options(pairs)
    except SystemExit as bad:
        raise _Unreadable(str(bad)) from None


def _status_line(status: dict) -> str:
    age = time.time() - status.get("updated_at", time.time())
    workers = ", ".join(f"r{w['rank']}:pid {w['pid']}" for w in status.get("workers", []))
    return (f"{status.get('state')}  step {status.get('step')}  world {status.get('world_size')}  "
            f"generation {status.get('generation')}  committed {status.get('last_committed_step')}  "
            f"updated {age:.0f}s ago  [{workers}]")


def cmd_stop(args: argparse.Namespace) -> int:
    """Exit 0 the stop is asked for; 1 the run has already ended; 2 no run there (no status.json)."""
    from checkpointing.lease import DEFAULT_STALE_AFTER_S, FINAL_STATES
    from elastic.stop_request import STOP_NAME, request_stop
    options = _parse_options(args.option)
    status = _read_json(args.url, "status.json", options)
    if status is None:
        print(f"no status.json under {mask_url(args.url)}: is this a run's storage URL?", file=sys.stderr)
        return 2
    state = status.get("state")
    if state in FINAL_STATES:
        print(f"the run under {mask_url(args.url)} has already ended (state {state!r}, step {status.get('step')}): "
              f"nothing to stop", file=sys.stderr)
        return 1
    request_stop(args.url, options, reason=args.reason, run_id=status.get("run_id"))
    print(f"stop requested: {mask_url(args.url)}/{STOP_NAME} written for run {status.get('run_id') or '(no run id)'} "
          f"(state {state}, step {status.get('step')}, generation {status.get('generation')}).")
    print("Every rank commits a checkpoint at the next step boundary, then the run ends with status "
          "\"stopped\"; run it again with the same storage to resume. Follow it with "
          f"`elastic status {mask_url(args.url)} --watch`.")
    updated = status.get("updated_at")
    if isinstance(updated, (int, float)) and time.time() - updated > DEFAULT_STALE_AFTER_S:
        print(f"note: status.json was last updated {time.time() - updated:.0f}s ago: the run may be dead; "
              f"then nothing reads the request, and the next run on this storage removes it when it starts",
              file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Exit 0; 1 when the run failed (status.json's state "failed"); 2 no run there; 3 the run
    says it is live but status.json has not been rewritten for DEFAULT_STALE_AFTER_S: probably
    dead (a live controller rewrites it every second or so)."""
    from checkpointing.lease import DEFAULT_STALE_AFTER_S, FINAL_STATES
    options = _parse_options(args.option)
    while True:
        status = _read_json(args.url, "status.json", options)
        if status is None:
            print(f"no status.json under {mask_url(args.url)}: is this a run's storage URL?", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(status), flush=True)
        else:
            print(_status_line(status), flush=True)
        state, updated = status.get("state"), status.get("updated_at")
        if state not in FINAL_STATES and isinstance(updated, (int, float)) and \
                time.time() - updated > DEFAULT_STALE_AFTER_S:
            print(f"status.json says {state!r} but was last updated {time.time() - updated:.0f}s ago (a live run "
                  f"rewrites it every second or so): the run is probably dead (its driver, its Ray or its job was "
                  f"stopped before it could write its end). Run it again with the same storage to resume from "
                  f"its last checkpoint; `elastic report` shows what it recorded.", file=sys.stderr)
            return 3
        if not args.watch or state in FINAL_STATES:
            return 1 if state == "failed" else 0
        time.sleep(args.interval)


_DEFAULT_PLOT = "<storage>/report.png"


def _write_plot(url: str, summary: dict | None, target: str, options: dict | None = None) -> int:
    """Render metrics.jsonl (+ recoveries) to `target`, or to <url>/report.png through Storage."""
    from elastic import _report_plot
    storage = Storage(url, options)
    from checkpointing.appendlog import read_log
    text = read_log(storage, storage.path("metrics.jsonl")).decode()   # the live segments too (S3)
    if not text:
        print(f"no metrics.jsonl under {mask_url(url)}: nothing to plot", file=sys.stderr)
        return 2
    try:
        png, drawn = _report_plot.render(_report_plot.parse_metrics(text), summary, title=mask_url(url))
    except (ValueError, RuntimeError) as error:
        print(f"cannot plot: {error}", file=sys.stderr)
        return 2
    if target == _DEFAULT_PLOT:
        path = storage.path("report.png")
        storage.write_atomic(path, png)
        target = storage.url_for(path)
    else:
        with open(target, "wb") as f:
            f.write(png)
    print(f"plot: {target} ({drawn['points']} steps, {len(drawn['recoveries_marked'])} recoveries marked"
          f"{', time ledger' if drawn.get('time_ledger') else ''})", file=sys.stderr)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Exit 0 the run finished or was stopped on request; 1 it did not (failed, stopped early);
    2 no summary."""
    options = _parse_options(args.option)
    summary = _read_json(args.url, "summary.json", options)
    if summary is None:
        print(f"no summary.json under {mask_url(args.url)}: the run has not ended (try `elastic status`)",
              file=sys.stderr)
        return 2
    if args.plot is not None and _write_plot(args.url, summary, args.plot, options) != 0:
        return 2
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0 if summary.get("status") in ("finished", "stopped") else 1
    print(f"status {summary['status']}  step {summary['final_step']}/{summary['total_steps']}  "
          f"wall {summary['wall_s']:.1f}s  goodput {summary['goodput']}  resumed from {summary['resumed_from']}")
    print(f"loss {summary['loss_first']} -> {summary['loss_last']}  model_sha256 {summary['model_sha256']}")
    print(f"world size history {summary['world_size_history']}  checkpoints {summary['checkpoints']}")
    ledger = summary.get("time_ledger")
    if ledger:
        print("time ledger  " + "  ".join(f"{part} {seconds:.1f}s" for part, seconds in ledger.items()))
    recoveries = summary.get("recoveries", [])
    if recoveries:
        columns = ("cause", "rung", "detect_s", "recover_s", "lost_steps", "from_world", "to_world", "step")
        parts = ("detection", "reform", "restore", "redone")     # each recovery's own time ledger
        print("\n" + "  ".join(f"{c:>11}" for c in columns + parts))
        for r in recoveries:
            own = r.get("time_ledger") or {}
            print("  ".join([f"{str(r.get(c)):>11}" for c in columns] + [f"{str(own.get(p, '')):>11}" for p in parts]))
    invocations = summary.get("invocations") or []
    if len(invocations) > 1:
        total = sum(len(i.get("recoveries") or []) for i in invocations)
        print(f"\n{len(invocations)} invocations, {total} recoveries in all (the table above: the last one's)")
        for n, i in enumerate(invocations, 1):
            print(f"  {n}: {i.get('status')} at step {i.get('final_step')} (resumed from {i.get('resumed_from')}), "
                  f"{len(i.get('recoveries') or [])} recoveries, wall {i.get('wall_s')}s, "
                  f"loss {i.get('loss_first')} -> {i.get('loss_last')}")
    if summary.get("error"):
        print(f"\nerror: {summary['error']['type']}: {summary['error']['message']}")
    return 0 if summary["status"] in ("finished", "stopped") else 1


def cmd_export(args: argparse.Namespace) -> int:
    """Exit 0 written; 1 the checkpoint does not match its manifest; 2 no such checkpoint,
    storage or usage error. One line on stderr for an error, progress lines on stderr."""
    from checkpointing import CorruptCheckpointError, export
    from checkpointing.errors import CheckpointError
    try:
        options = _parse_options(args.option)
    except _Unreadable as bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2

    def report(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        if args.format == "hf":
            from checkpointing import export_hf
            result = export_hf(args.url, args.out, config=args.config, module=args.module, step=args.step,
                               storage_options=options, progress=report)
        else:
            if args.config is not None or args.module is not None:
                print("error: --config and --module go with --format hf", file=sys.stderr)
                return 2
            result = export(args.url, args.out, step=args.step, storage_options=options, progress=report)
    except CheckpointError as error:
        one_line = " ".join(str(error).split())
        print(f"error: {one_line}", file=sys.stderr)
        return 1 if isinstance(error, CorruptCheckpointError) else 2
    if args.format == "hf":
        print(f"exported step {result.step} of '{result.modules[0]}' to {result.out} (from_pretrained reads it): "
              f"{result.tensors} tensors, {result.bytes / 1e6:.1f} MB")
        return 0
    shape = (f"{{name: state_dict}} for {', '.join(result.modules)}" if result.nested
             else f"the state dict of '{result.modules[0]}'")
    size = f"{result.bytes / 1e6:.1f} MB" if result.bytes >= 1e5 else f"{result.bytes / 1e3:.1f} kB"
    print(f"exported step {result.step} to {result.out}: {shape}, {result.tensors} tensors, {size}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ckpt"]:
        from checkpointing.cli import main as checkpoint_main
        return checkpoint_main(argv[1:])
    if argv[:1] == ["chaos"]:
        # Imported only here: the chaos suite drives the runtime from outside and is not part of it.
        from chaos.__main__ import main as chaos_main
        return chaos_main(argv[1:])
    parser = argparse.ArgumentParser(prog="elastic", description="Look at an elastic run from outside.")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="live view of <URL>/status.json")
    status.add_argument("url")
    status.add_argument("--watch", action="store_true", help="keep printing until the run ends")
    status.add_argument("--interval", type=float, default=2.0)
    status.add_argument("--json", action="store_true", help="print status.json as is (one line per read)")
    status.set_defaults(run=cmd_status)
    report = sub.add_parser("report", help="summary and recoveries of a run")
    report.add_argument("url")
    report.add_argument("--json", action="store_true", help="print summary.json as is")
    stop = sub.add_parser(
        "stop", help="commit a checkpoint at the next step and end the run (status \"stopped\", resumable)",
        description="Ask the live run under STORAGE to stop: every rank commits a checkpoint at the next "
                    "step boundary and the run ends with status \"stopped\", resumable by running it "
                    "again with the same storage (the graceful counterpart of `ray job stop`, which "
                    "loses the steps since the last checkpoint). Writes <STORAGE>/STOP. Exit 0 asked, "
                    "1 the run has already ended, 2 no run there (no status.json) or a storage error.")
    stop.add_argument("url", metavar="STORAGE", help="the run's storage URL (where its status.json is)")
    stop.add_argument("--reason", default="", metavar="TEXT", help="why, kept in STOP for whoever reads it")
    stop.set_defaults(run=cmd_stop)
    for command in (status, report, stop):
        command.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                             help="fsspec storage option, e.g. endpoint_url=http://127.0.0.1:9000 or anon=true "
                                  "(values read as JSON where they can; AWS_* variables also work)")
    report.add_argument("--plot", nargs="?", const=_DEFAULT_PLOT, metavar="PATH",
                        help="also draw loss, world size and LR over time with recoveries marked, as a PNG "
                             "(default PATH: <URL>/report.png; needs matplotlib)")
    report.set_defaults(run=cmd_report)
    export_cmd = sub.add_parser(
        "export", help="write the model weights of a committed checkpoint to one torch.load-able file",
        description="Write the model weights of a committed checkpoint (default: the newest one "
                    "that matches its manifest) to one file that plain "
                    "torch.load(FILE, weights_only=True) reads. Exit 0 written, 1 the checkpoint "
                    "does not match its manifest, 2 no such checkpoint or a storage error.")
    export_cmd.add_argument("url", metavar="STORAGE", help="the run's storage URL (checkpoints/ is below it)")
    export_cmd.add_argument("--step", type=int, default=None,
                            help="this committed step (default: the newest that verifies)")
    export_cmd.add_argument("--out", required=True, metavar="PATH",
                            help="local file to write (--format hf: the directory)")
    export_cmd.add_argument("--format", choices=("torch", "hf"), default="torch",
                            help="torch: one torch.save file (default); hf: a Hugging Face directory, "
                                 "model.safetensors and config.json (needs safetensors: elastic-train[hf])")
    export_cmd.add_argument("--config", default=None, metavar="FILE",
                            help="--format hf: the model's config.json (or the directory holding it); default: "
                                 "<URL>/hf/config.json, where examples/hf_llama.py writes it")
    export_cmd.add_argument("--module", default=None, metavar="NAME",
                            help="--format hf: the checkpoint's module entry to export (default: the only one)")
    export_cmd.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                            help="fsspec storage option, e.g. endpoint_url=http://127.0.0.1:9000 "
                                 "(credentials and endpoint also come from the AWS_* variables)")
    export_cmd.set_defaults(run=cmd_export)
    sub.add_parser("ckpt", help="list|verify|gc URL: committed checkpoints")
    sub.add_parser("chaos", help="run|list|schedule|heal: fault injection (python -m chaos)")
    args = parser.parse_args(argv)
    try:
        code = args.run(args)
        sys.stdout.flush()          # a reader that left (`| head`) is met here, not at exit
        return code
    except BrokenPipeError:
        # The reader of stdout left (`elastic report | head`): nothing more to say, and no
        # traceback at exit either (Python's recipe: stdout to devnull; its docs' "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (StorageError, _Unreadable) as error:
        # One line, no traceback: the URL, what failed, what to check.
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

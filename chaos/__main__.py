"""Command line: `python -m chaos run SCENARIO --seed S --storage URL [--steps N]`.

    python -m chaos list                                 the named scenarios
    python -m chaos schedule mixed --seed 3              the faults a seed gives, as JSON
    python -m chaos run smoke --seed 1 --storage s3://chaos/smoke --moto
    python -m chaos heal --id ID                         remove what a killed runner's namespaced cluster left
                                                         (ID: in its history.jsonl; `heal` alone lists them)

`run` exits 0 when every invariant holds, 1 when one is violated, 2 on a usage or setup error,
130 when interrupted (Ctrl-C, SIGTERM) after the final heal.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from chaos.scenarios import SCENARIOS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chaos", description="Fault injection for elastic training runs.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the named scenarios")
    s = sub.add_parser("schedule", help="print a scenario's schedule for a seed")
    s.add_argument("scenario", choices=sorted(SCENARIOS))
    s.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="run a scenario against the main job and check the invariants")
    r.add_argument("scenario", choices=sorted(SCENARIOS))
    r.add_argument("--seed", type=int, default=0, help="seed of the schedule and of target choices")
    r.add_argument("--storage", required=True, help="run storage: local path, file:// or s3://bucket/prefix (empty)")
    r.add_argument("--steps", type=int, help="total steps of the job (default: the scenario's)")
    r.add_argument("--workers", help="MIN:MAX workers (default: the scenario's, min == max)")
    r.add_argument("--faults", type=int, help="inject only the first N faults of the schedule (a short version)")
    r.add_argument("--out", help="report directory (default runs/chaos/SCENARIO-seedS)")
    r.add_argument("--moto", action="store_true", help="start a local moto S3 server for s3:// storage")
    r.add_argument("--reference", default="auto",
                   help="fault-free reference: auto (train or reuse STORAGE-reference), none, or a run's URL")
    r.add_argument("--reference-after", action="store_true",
                   help="train the reference after the campaign, not alongside it at nice 19")
    r.add_argument("--overwrite", action="store_true",
                   help="delete what is in --storage first, and in STORAGE-reference unless it holds a reusable "
                        "reference of this job")
    r.add_argument("--job", help="script that follows the main job's contract (default examples/pretrain.py)")
    r.add_argument("--job-arg", action="append", default=[], help="extra argument for the job (repeatable)")
    r.add_argument("--timeout", type=float, help="seconds before an attempt of the job is stopped")
    r.add_argument("-v", "--verbose", action="store_true")
    h = sub.add_parser("heal", help="remove the network namespaces, links and bridges a killed runner left")
    h.add_argument("--id", help="the campaign's five-digit cluster id (its history.jsonl's `cluster` event; "
                                "`heal` without --id lists those on this machine), or 'all' for every campaign's, "
                                "running ones included")
    return p


def _terminate(signum, frame):
    # SIGTERM unwinds like Ctrl-C, so the runner's final heal and teardown run.
    raise KeyboardInterrupt(f"signal {signum}")


def _heal(campaign: str | None) -> int:
    from chaos.netns import ID_RE, cleanup_leftovers, leftover_ids
    if campaign is None:
        ids = leftover_ids()
        print(json.dumps({"campaigns": ids}))
        print("chaos heal: pass --id ID for one campaign's cluster"
              + (f" (found: {', '.join(ids)})" if ids else " (none found here)") + ", or --id all", file=sys.stderr)
        return 2
    if campaign != "all" and not ID_RE.match(campaign):
        print(f"chaos heal: --id {campaign!r}: a five-digit campaign id, or 'all'", file=sys.stderr)
        return 2
    print(json.dumps(cleanup_leftovers(campaign)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "list":
        for sc in SCENARIOS.values():
            print(f"{sc.name:<12} {sc.description}  (steps {sc.steps}, workers {sc.workers}"
                  f"{f', tp {sc.tensor_parallel}' if sc.tensor_parallel > 1 else ''}"
                  f"{f', pp {sc.pipeline_parallel}' if sc.pipeline_parallel > 1 else ''}"
                  f"{f', spares {sc.spare_workers}' if sc.spare_workers else ''}"
                  f"{f', nodes {sc.nodes}' if sc.nodes else ''})")
        return 0
    if args.command == "schedule":
        print(json.dumps(SCENARIOS[args.scenario].schedule(args.seed).to_dict(), indent=1))
        return 0
    if args.command == "heal":
        return _heal(args.id)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from chaos.report import summarize
    from chaos.runner import RunOptions, run
    out = args.out or os.path.join("runs", "chaos", f"{args.scenario}-seed{args.seed}")
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        outcome = run(RunOptions(scenario=SCENARIOS[args.scenario], seed=args.seed, storage=args.storage, out_dir=out,
                                 steps=args.steps, workers=args.workers, script=args.job,
                                 extra_args=tuple(args.job_arg), moto=args.moto, reference=args.reference,
                                 reference_alongside=not args.reference_after,
                                 overwrite=args.overwrite, timeout_s=args.timeout, max_faults=args.faults))
    except SystemExit as e:
        print(f"chaos: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # The final heal and teardown have run on the way out; what was recorded stays.
        print(f"chaos: interrupted ({e}); faults healed, job stopped; history in "
              f"{os.path.join(out, 'history.jsonl')}, no verdicts", file=sys.stderr)
        return 130
    finally:
        # Called in-process too (`elastic chaos`, tests): leave the caller's SIGTERM handling as it was.
        signal.signal(signal.SIGTERM, previous)
    print(summarize(outcome.report))
    print(f"report: {os.path.join(out, 'chaos_report.json')} and chaos_report.png")
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The runner: one chaos run from start to verdict.

    services     a private RAY_TMPDIR; an S3 endpoint (moto, with --moto) and its bucket
    campaign     the job's attempts under the nemesis, and the final heal (chaos.campaign)
    reference    the same job without faults (cached per job and code), for model_sha256; trained
                 alongside the campaign at the lowest CPU priority unless told otherwise
    verdict      invariants on the history and the run's records; chaos_report.json and .png
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field

from chaos import invariants
from chaos.campaign import Campaign
from chaos.faults import BadGradient, BitFlip
from chaos.history import History
from chaos.job import DEFAULT_SCRIPT, JobSpec
from chaos.observe import RunView, fence_facts
from chaos.reference import check_reference_storage, reference_run, start_reference
from chaos.report import write_report
from chaos.scenarios import Scenario, check_workers
from chaos.schedule import Schedule
from chaos.services import MOTO_CREDENTIALS, MotoServer, ensure_bucket, is_s3
from checkpointing.errors import CheckpointError

log = logging.getLogger("chaos.runner")


@dataclass
class RunOptions:
    scenario: Scenario
    seed: int
    storage: str
    out_dir: str
    steps: int | None = None
    workers: str | None = None
    script: str | None = None
    extra_args: tuple[str, ...] = ()
    moto: bool = False
    reference: str = "auto"                 # "auto", "none", or a storage URL of a finished run
    reference_alongside: bool = True        # train an "auto" reference during the campaign, at nice 19
    # ... started once the job first trains rather than with it: on a small machine a reference
    # started with the job slows the job's start, and the campaign's recoveries leave it CPU after
    reference_once_running: bool = False
    overwrite: bool = False
    timeout_s: float | None = None          # per attempt of the job
    schedule: Schedule | None = None        # overrides the scenario's (tests)
    max_faults: int | None = None           # keep only the first N scheduled faults (short runs)


@dataclass
class Outcome:
    report: dict
    verdicts: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(v.failed for v in self.verdicts)


def job_spec(opts: RunOptions) -> JobSpec:
    """The job the scenario runs (its reference is the same, on another storage): the layout
    (workers, TP and PP degrees, spares) is the scenario's, `--workers` aside. SystemExit (a usage
    error) for a `--workers` override that is not whole replicas of the scenario's T x P ranks."""
    sc = opts.scenario
    workers = opts.workers or sc.workers
    try:
        check_workers(workers, sc.tensor_parallel, sc.spare_workers, pp=sc.pipeline_parallel,
                      what=f"--workers {workers}")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return JobSpec(storage=opts.storage, workers=workers, steps=opts.steps or sc.steps,
                   checkpoint_every=sc.checkpoint_every, heartbeat_timeout_s=sc.heartbeat_timeout_s,
                   model_size=sc.model_size, strategy=sc.strategy, tp=sc.tensor_parallel,
                   pp=sc.pipeline_parallel, spare_workers=sc.spare_workers, cpus_per_worker=sc.cpus_per_worker,
                   extra_args=tuple(opts.extra_args), script=opts.script or DEFAULT_SCRIPT)


def run(opts: RunOptions) -> Outcome:
    sc = opts.scenario
    spec = job_spec(opts)
    schedule = opts.schedule or sc.schedule(opts.seed)
    if opts.max_faults is not None:
        schedule = dataclasses.replace(schedule, entries=schedule.entries[:opts.max_faults])
    os.makedirs(opts.out_dir, exist_ok=True)
    if any(isinstance(entry.fault, BitFlip | BadGradient) for entry in schedule.entries):
        # The workers look for bit-flip requests here (chaos.injectors.process.BitFlipInjector).
        requests = os.path.join(os.path.abspath(opts.out_dir), "bitflip")
        os.makedirs(requests, exist_ok=True)
        spec = spec.replace(bitflip_requests=requests)
    for name in ("history.jsonl", "chaos_report.json", "chaos_report.png"):
        if os.path.exists(os.path.join(opts.out_dir, name)):
            os.remove(os.path.join(opts.out_dir, name))
    history = History(os.path.join(opts.out_dir, "history.jsonl"))
    history.record("schedule", scenario=sc.name, seed=opts.seed, schedule=schedule.to_dict(), job=spec.argv())
    try:
        with _private_ray_tmpdir(), _s3_endpoint(opts) as upstream:
            return _run(opts, sc, schedule, spec, history, upstream)
    finally:
        history.close()


def _run(opts: RunOptions, sc: Scenario, schedule: Schedule, spec: JobSpec, history: History,
         upstream: str | None) -> Outcome:
    options = {"endpoint_url": upstream} if upstream else None
    view = RunView(opts.storage, options)
    _prepare_storage(view, opts.overwrite)
    check_reference_storage(spec, opts.reference, options, opts.overwrite)
    started: list = []          # the reference trained alongside the campaign, once started
    planned = spec              # the job as planned (the campaign may run it longer)

    def start_alongside() -> None:
        if opts.reference_alongside and not started:
            started.append(start_reference(planned, opts.reference, options, opts.out_dir, history))

    campaign = Campaign(sc, spec, schedule, view, history, out_dir=opts.out_dir, upstream=upstream,
                        timeout_s=opts.timeout_s, on_running=start_alongside if opts.reference_once_running else None)
    if not opts.reference_once_running:
        start_alongside()
    try:
        spec = campaign.run()          # the job as last run: its --steps may have grown
        reference = None
        if opts.reference != "none":
            reference = reference_run(spec, opts.reference, options, opts.out_dir, history,
                                      timeout_s=opts.timeout_s or sc.job_timeout_s,
                                      started=started[0] if started else None)
    finally:
        if started and started[0] is not None:
            started[0].stop()
    evidence = invariants.Evidence(
        history=history.events, attempts=campaign.attempts, total_steps=spec.steps,
        heartbeat_timeout_s=sc.heartbeat_timeout_s, metrics=view.metrics(), reference=reference,
        final_verification=[{"step": c.step, "generation": c.generation, "problems": view.verify(c)}
                            for c in view.committed()],
        fence=_final_fence(view))
    verdicts = invariants.check_all(evidence)
    report = write_report(opts.out_dir, scenario=sc, seed=opts.seed, spec=spec, schedule=schedule,
                          evidence=evidence, verdicts=verdicts, unsupported=campaign.info["unsupported"],
                          proxy_counts=campaign.info["proxy_counts"], cluster=campaign.info["cluster"])
    return Outcome(report, verdicts)


def _final_fence(view: RunView) -> dict | None:
    """FENCE at the end (its history judges loads and lost commits); None if unreadable."""
    try:
        return fence_facts(view.fence())
    except CheckpointError as e:     # the invariants that need it skip
        log.warning("FENCE unreadable at the end of the run: %s", e)
        return None


@contextlib.contextmanager
def _private_ray_tmpdir():
    """Every Ray this run starts (its cluster, the job's embedded one, the reference's) keeps
    its sessions and its "current cluster" address file under a private RAY_TMPDIR: a bare
    `ray.init()` elsewhere on the machine must not join a cluster chaos is tearing apart, and
    the job must not join someone else's."""
    private = tempfile.mkdtemp(prefix="chx-ray-", dir="/tmp")   # short: Ray's socket paths
    with _environ(RAY_TMPDIR=private):
        try:
            yield private
        finally:
            shutil.rmtree(private, ignore_errors=True)


@contextlib.contextmanager
def _s3_endpoint(opts: RunOptions):
    """The S3 endpoint of s3:// storage (None otherwise): a local moto server with --moto,
    else the standard AWS variables'. Creates the bucket if needed."""
    if not is_s3(opts.storage):
        yield None
        return
    if not opts.moto:
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        ensure_bucket(opts.storage, endpoint)
        yield endpoint
        return
    with MotoServer(os.path.join(opts.out_dir, "moto.log")) as moto, \
            _environ(**MOTO_CREDENTIALS, AWS_ENDPOINT_URL=moto.endpoint, AWS_ENDPOINT_URL_S3=None):
        ensure_bucket(opts.storage, moto.endpoint)
        yield moto.endpoint


@contextlib.contextmanager
def _environ(**values: str | None):
    """Set (None: unset) environment variables for the block; jobs and their Ray inherit them."""
    previous = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _prepare_storage(view: RunView, overwrite: bool) -> None:
    if view.is_empty():
        return
    if not overwrite:
        raise SystemExit(f"storage {view.url} is not empty: a chaos run starts from scratch; "
                         f"pass --overwrite to delete what is there")
    view.storage.rm(view.storage.root, recursive=True)

"""The fault-free reference run that model_sha256 is compared with.

The same job (same script, workers, steps, seed, model) on its own storage, with no faults and
the job's embedded Ray. It is cached: the storage keeps a `chaos_reference.json` with the job's
identity, and a finished reference with the same identity is reused instead of trained again.

By default it trains alongside the campaign at the lowest CPU priority (nice 19): the chaos run
keeps the machine and the reference gets what the campaign leaves idle (detection timeouts,
restarts), so the two take little more wall time than the campaign alone. If the campaign ran
the job longer than planned, that reference is discarded and the right one trained after.

Like the run's own storage, `<storage>-reference` is only ever cleared with `--overwrite`: before
anything runs, `check_reference_storage` refuses one that is neither empty nor a reusable
reference of this job (it may be somebody's run that happens to sit there).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time

from chaos.history import History
from chaos.job import JobProcess, JobSpec
from chaos.observe import RunView

log = logging.getLogger("chaos.reference")

MARKER = "chaos_reference.json"


def code_fingerprint(script: str) -> str:
    """Hash of the job script's directory and of the runtime packages: a reference trained by
    other code is not reused (numerics change between versions)."""
    dirs = [os.path.dirname(os.path.abspath(script))]
    for package in ("elastic", "checkpointing"):
        spec = importlib.util.find_spec(package)     # locates without importing
        dirs += list(spec.submodule_search_locations or []) if spec else []
    digest = hashlib.sha256()
    for d in dirs:
        for name in sorted(os.listdir(d)):
            if name.endswith(".py"):
                digest.update(name.encode())
                with open(os.path.join(d, name), "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def reference_url(storage: str) -> str:
    return storage.rstrip("/") + "-reference"


def check_reference_storage(spec: JobSpec, choice: str, storage_options: dict | None, overwrite: bool) -> None:
    """Before the campaign: an "auto" reference storage must be empty, hold a finished
    reference of this very job (it is reused), or be cleared with `overwrite`. SystemExit
    (a usage error) otherwise."""
    if choice != "auto":
        return
    url = reference_url(spec.storage)
    view = RunView(url, storage_options)
    if view.is_empty() or overwrite or _cached(url, view, _identity(spec), History()) is not None:
        return
    what = "an older chaos reference (other job or code)" if view.read_json(MARKER) is not None else "something"
    raise SystemExit(f"reference storage {url} holds {what}, not a reusable reference of this job: pass "
                     f"--overwrite to delete it, or --reference none / --reference URL-of-a-finished-run")


def _cached(url: str, view: RunView, identity: dict, history: History) -> dict | None:
    summary = view.summary()
    if summary is not None and summary.get("status") == "finished" and view.read_json(MARKER) == identity:
        history.record("reference", url=url, reused=True, status="finished")
        return {"url": url, "summary": summary, "metrics": view.metrics(), "reused": True}
    return None


def _identity(spec: JobSpec) -> dict:
    # Lists, not tuples, as when read back.
    return json.loads(json.dumps({**spec.identity(), "code": code_fingerprint(spec.script)}))


class ReferenceJob:
    """A fault-free run of `spec` into `<storage>-reference`, started now, collected by `result`."""

    def __init__(self, spec: JobSpec, storage_options: dict | None, out_dir: str, history: History,
                 nice: int = 0):
        self.spec, self.out_dir, self.history = spec, out_dir, history
        self.url = reference_url(spec.storage)
        self.view = RunView(self.url, storage_options)
        self.identity = _identity(spec)
        if not self.view.is_empty():
            # Cleared only after check_reference_storage allowed it (empty, --overwrite, or a
            # reference of this job that a longer campaign made useless).
            self.view.storage.rm(self.view.storage.root, recursive=True)
        # Its own embedded Ray, in a fresh temp dir: the chaos run's cluster may have left its
        # address there, and a bare ray.init() would try to join it.
        self.ray_tmp = tempfile.mkdtemp(prefix="r", dir=os.environ.get("RAY_TMPDIR") or None)
        env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_TMPDIR=self.ray_tmp)
        env.pop("RAY_ADDRESS", None)
        self.job = JobProcess(spec.replace(storage=self.url, fail_at=None), env, os.path.join(out_dir, "reference.log"),
                              prefix=["nice", "-n", str(nice)] if nice else []).start()
        history.record("reference", url=self.url, reused=False, argv=self.job.spec.argv(), nice=nice)

    def _full_priority(self) -> None:
        """The campaign is over: the reference (the job's process group, its Ray included)
        goes back to normal priority. Raising a priority needs root; without it, it stays low."""
        try:
            os.setpriority(os.PRIO_PGRP, self.job.process.pid, 0)
        except OSError as e:
            log.info("the reference keeps its low CPU priority: %s", e)

    def stop(self) -> None:
        self.job.stop()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def result(self, timeout_s: float) -> dict:
        self._full_priority()
        deadline = time.monotonic() + timeout_s
        try:
            while self.job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)   # polling interval of the job's exit, not a synchronisation sleep
        finally:
            code = self.job.stop()
            shutil.rmtree(self.ray_tmp, ignore_errors=True)
        summary = self.view.summary()
        self.history.record("reference_done", url=self.url, exit_code=code, status=(summary or {}).get("status"))
        with open(os.path.join(self.out_dir, "reference-metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in self.view.metrics())
        if summary is None or summary.get("status") != "finished":
            log.warning("the reference run did not finish (exit %s); see %s/reference.log", code, self.out_dir)
        else:
            self.view.storage.write_atomic(self.view.storage.path(MARKER), json.dumps(self.identity).encode())
        return {"url": self.url, "summary": summary, "metrics": self.view.metrics(), "reused": False}


def start_reference(spec: JobSpec, choice: str, storage_options: dict | None, out_dir: str,
                    history: History) -> ReferenceJob | None:
    """With `choice` "auto" and no cached reference: the reference, started now at nice 19 to
    train alongside the campaign. None otherwise (`reference_run` decides after the campaign)."""
    if choice != "auto":
        return None
    url = reference_url(spec.storage)
    if _cached(url, RunView(url, storage_options), _identity(spec), History()) is not None:
        return None
    return ReferenceJob(spec, storage_options, out_dir, history, nice=19)


def reference_run(spec: JobSpec, choice: str, storage_options: dict | None, out_dir: str, history: History,
                  timeout_s: float, started: ReferenceJob | None = None) -> dict | None:
    """`choice` is "auto" (train or reuse `<storage>-reference`) or the URL of a finished run.
    `started`: the reference `start_reference` began alongside the campaign, used if it is of
    the job as last run (`spec`), else stopped and trained again."""
    if choice != "auto":
        view = RunView(choice, storage_options)
        summary = view.summary()
        if summary is None:
            history.record("reference", url=choice, error="no summary.json there")
            return None
        history.record("reference", url=choice, reused=True, status=summary.get("status"))
        return {"url": choice, "summary": summary, "metrics": view.metrics(), "reused": True}
    if started is not None:
        if started.spec == spec:
            return started.result(timeout_s)
        history.record("reference_discarded", url=started.url, reason="the campaign ran the job longer")
        started.stop()
    url = reference_url(spec.storage)
    cached = _cached(url, RunView(url, storage_options), _identity(spec), history)
    if cached is not None:
        return cached
    return ReferenceJob(spec, storage_options, out_dir, history).result(timeout_s)

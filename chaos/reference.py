"""The fault-free reference run that model_sha256 is compared with.

The same job (same script, workers, steps, seed, model) on its own storage, with no faults and
the job's embedded Ray. It is cached: the storage keeps a `chaos_reference.json` with the job's
identity, and a finished reference with the same identity is reused instead of trained again.
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


def reference_run(spec: JobSpec, choice: str, storage_options: dict | None, out_dir: str, history: History,
                  timeout_s: float) -> dict | None:
    """`choice` is "auto" (train or reuse `<storage>-reference`) or the URL of a finished run."""
    url = reference_url(spec.storage) if choice == "auto" else choice
    view = RunView(url, storage_options)
    # Lists, not tuples, as when read back.
    identity = json.loads(json.dumps({**spec.identity(), "code": code_fingerprint(spec.script)}))
    summary = view.summary()
    if choice != "auto":
        if summary is None:
            history.record("reference", url=url, error="no summary.json there")
            return None
        history.record("reference", url=url, reused=True, status=summary.get("status"))
        return {"url": url, "summary": summary, "metrics": view.metrics(), "reused": True}
    if summary is not None and summary.get("status") == "finished" and view.read_json(MARKER) == identity:
        history.record("reference", url=url, reused=True, status="finished")
        return {"url": url, "summary": summary, "metrics": view.metrics(), "reused": True}
    if not view.is_empty():
        view.storage.rm(view.storage.root, recursive=True)
    # Its own embedded Ray, in a fresh temp dir: the chaos run's cluster may have left its
    # address there, and a bare ray.init() would try to join it.
    ray_tmp = tempfile.mkdtemp(prefix="r", dir=os.environ.get("RAY_TMPDIR") or None)
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_TMPDIR=ray_tmp)
    env.pop("RAY_ADDRESS", None)
    job = JobProcess(spec.replace(storage=url, fail_at=None), env, os.path.join(out_dir, "reference.log")).start()
    history.record("reference", url=url, reused=False, argv=job.spec.argv())
    deadline = time.monotonic() + timeout_s
    try:
        while job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)   # polling interval of the job's exit, not a synchronisation sleep
    finally:
        code = job.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    summary = view.summary()
    history.record("reference_done", url=url, exit_code=code, status=(summary or {}).get("status"))
    with open(os.path.join(out_dir, "reference-metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in view.metrics())
    if summary is None or summary.get("status") != "finished":
        log.warning("the reference run did not finish (exit %s); see %s/reference.log", code, out_dir)
        return {"url": url, "summary": summary, "metrics": view.metrics(), "reused": False}
    view.storage.write_atomic(view.storage.path(MARKER), json.dumps(identity).encode())
    return {"url": url, "summary": summary, "metrics": view.metrics(), "reused": False}

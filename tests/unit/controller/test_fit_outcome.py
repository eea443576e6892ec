"""fit() never raises once the run has started (review F12): a storage that fails the last
metrics lines still gets summary.json, a dead controller is a failed Result with a typed error
and status.json saying so, and a Ray that fit() started is shut down when it returns.

fit() runs here against a fake of the few `ray` functions it calls (no Ray is started)."""
import errno
import json
from types import SimpleNamespace

import pytest
import ray
from ray.exceptions import ActorDiedError, RayTaskError

from checkpointing import RunConflictError
from elastic import CheckpointConfig, ElasticTrainer, ScalingConfig, WorkerLostError
from elastic import trainer as trainer_module
from elastic._controller.actor import ControllerActor
from elastic._controller.run_record import RunRecorder
from elastic._controller.states import RunState
from elastic._protocol import StepRecord

pytestmark = pytest.mark.timeout(30)


def loop(ctx):
    pass


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def recorder_with_a_full_disk(tmp_path, background=False):
    recorder = RunRecorder(str(tmp_path), None, total_steps=10, config={"seed": 0}, background=background)
    recorder.on_generation_start(0, 1)
    recorder.on_step(StepRecord(step=1, loss=2.5, world_size=1, time=1.0, samples_seen=4, global_batch=4))
    recorder._storage.append = no_space
    return recorder


@pytest.mark.parametrize("background", [False, True])
def test_summary_json_is_written_when_the_last_metrics_lines_cannot_be(tmp_path, background):
    recorder = recorder_with_a_full_disk(tmp_path, background)
    summary = recorder.write_summary(status="failed", final_step=1, checkpoints=[], model_sha256=None,
                                     error={"type": "StorageError", "message": "disk full", "traceback": None,
                                            "ranks": []})
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary and on_disk["status"] == "failed" and on_disk["loss_last"] == 2.5


class FakeController:
    """What ControllerActor.run reads of the controller: a run that failed."""

    def __init__(self):
        self.state = SimpleNamespace(state=RunState.FAILED)
        self.error = {"type": "StorageError", "message": "disk full", "traceback": None, "exception": None,
                      "ranks": []}
        self.step, self.total_steps, self.model_sha256 = 1, 10, None
        self.done = True                              # run_loop ticks nothing, then shuts the group down
        self.group = SimpleNamespace(shutdown=lambda graceful: None)

    def flush_logs(self):
        pass


def test_the_controller_actor_returns_its_outcome_when_storage_fails_at_the_end(tmp_path):
    actor = object.__new__(ControllerActor)
    actor._controller = FakeController()
    actor._checkpoints = SimpleNamespace(committed_steps=lambda: [])
    actor._recorder = recorder_with_a_full_disk(tmp_path)
    actor._run_id = None                          # no lease to release
    outcome = actor.run()                         # raised OSError before: ray.get(done) then raised in fit()
    assert outcome["status"] == "failed" and outcome["summary"]["status"] == "failed"
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "failed"


class FakeRay:
    """The `ray` functions fit() calls, with the controller's outcome (or error) scripted."""

    def __init__(self, *, initialized=True, outcome=None, error=None, before_get=None):
        self.initialized, self.outcome, self.error, self.before_get = initialized, outcome, error, before_get
        self.calls: list[str] = []
        self.options: dict = {}
        self.args: tuple = ()

    def install(self, monkeypatch, local_started=True):
        for name in ("is_initialized", "init", "shutdown", "get_runtime_context", "remote", "wait", "get", "kill"):
            monkeypatch.setattr(ray, name, getattr(self, name))
        # No Ray initialized: fit() starts the run's own local Ray (elastic.local_ray), or finds
        # the one the storage's earlier driver started (`local_started` False).
        calls = self.calls

        class FakeLocalRay:
            def __init__(self, storage):
                self.storage = storage

            def connect(self):
                calls.append("local_connect")
                return "127.0.0.1:1", local_started

            def stop(self):
                calls.append("local_stop")
        monkeypatch.setattr(trainer_module, "LocalRay", FakeLocalRay)
        monkeypatch.setattr(trainer_module, "local_ray_supported", lambda: True)
        monkeypatch.setattr(trainer_module, "_starts_local_ray", lambda: True)

    def is_initialized(self):
        return self.initialized

    def init(self, **kwargs):
        self.calls.append("init")
        self.initialized = True

    def shutdown(self):
        self.calls.append("shutdown")
        self.initialized = False

    def get_runtime_context(self):
        return SimpleNamespace(get_node_id=lambda: "ab" * 28)

    def remote(self, cls):
        fake = self
        method = SimpleNamespace(remote=lambda *a, **k: "ref")
        handle = SimpleNamespace(wait=method, events=method, snapshot=method)

        class ActorClass:
            def options(self, **options):
                fake.options = options
                return self

            def remote(self, *args, **kwargs):
                fake.args = args
                return handle
        return ActorClass()

    def wait(self, refs, timeout=None):
        return refs, []

    def get(self, ref, timeout=None):
        if self.before_get is not None:
            self.before_get()
        if self.error is not None:
            raise self.error
        return self.outcome

    def kill(self, actor, no_restart=True):
        self.calls.append("kill")


def trainer(tmp_path, **kwargs):
    return ElasticTrainer(loop, scaling=ScalingConfig(), total_steps=10,
                          checkpoint=CheckpointConfig(storage=str(tmp_path), **kwargs))


@pytest.mark.parametrize("error, typed", [(ActorDiedError(), WorkerLostError),
                                          (RayTaskError("run", "Traceback ...", OSError("disk")), Exception)])
def test_a_lost_controller_is_a_failed_result_and_the_driver_records_it(tmp_path, monkeypatch, error, typed):
    fake = FakeRay(error=error)
    fake.install(monkeypatch)
    (tmp_path / "summary.json").write_text(json.dumps({"status": "finished", "final_step": 10}))  # a previous attempt's
    result = trainer(tmp_path).fit()              # raised the RayActorError before
    assert result.status == "failed" and not result.ok and isinstance(result.error, typed)
    assert "controller" in str(result.error) and "kill" in fake.calls
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "failed" and status["error"]["type"] == type(result.error).__name__
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == result.summary and summary["status"] == "failed"
    assert summary["error"]["message"] == str(result.error) and summary["total_steps"] == 10


@pytest.mark.parametrize("status", ["finished", "failed"])
def test_a_complete_record_of_the_controller_is_kept_when_its_outcome_is_lost(tmp_path, monkeypatch, status):
    """The controller wrote summary.json, then its final status.json, then died (or its outcome
    could not be unpickled in the driver): its record stands, the driver overwrites nothing."""
    import time

    from ray.exceptions import RaySystemError
    error = {"type": "ValueError", "message": "bad batch", "traceback": "Traceback ...", "ranks": [0]}
    summary = {"status": status, "final_step": 10, "checkpoints": [10], "error": None if status == "finished"
               else error}

    def controller_ends():
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        (tmp_path / "status.json").write_text(json.dumps({"state": status, "updated_at": time.time()}))
    fake = FakeRay(error=RaySystemError("could not deserialize the outcome"), before_get=controller_ends)
    fake.install(monkeypatch)
    result = trainer(tmp_path).fit()
    assert result.status == status and result.summary == summary
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert json.loads((tmp_path / "status.json").read_text())["state"] == status
    if status == "finished":
        assert result.ok and result.error is None
    else:
        assert str(result.error) == "ValueError: bad batch" and result.error_traceback == "Traceback ..."


OUTCOME = {"status": "finished", "final_step": 10, "summary": {"status": "finished", "checkpoints": [10]},
           "metrics": {"last": {}, "history": {}}, "error": None, "traceback": None}


STARTED_HERE = ["local_connect", "init", "kill", "shutdown", "local_stop"]


@pytest.mark.parametrize("initialized, calls", [(False, STARTED_HERE), (True, ["kill"])])
def test_fit_shuts_down_the_ray_it_started_and_only_that(tmp_path, monkeypatch, initialized, calls):
    fake = FakeRay(initialized=initialized, outcome=OUTCOME)
    fake.install(monkeypatch)
    result = trainer(tmp_path).fit()
    assert result.ok and result.checkpoint.endswith("checkpoints/step_00000010")
    assert fake.calls == calls


def test_fit_shuts_down_the_ray_it_started_when_the_driver_is_interrupted(tmp_path, monkeypatch):
    fake = FakeRay(initialized=False, error=KeyboardInterrupt())
    fake.install(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        trainer(tmp_path).fit()
    assert fake.calls == STARTED_HERE       # Ctrl-C ended the run: its local Ray goes too


@pytest.mark.parametrize("started, calls", [(False, ["local_connect", "init", "shutdown"]),
                                             (True, ["local_connect", "init", "shutdown", "local_stop"])])
def test_a_fit_refused_by_a_live_run_leaves_that_runs_local_ray_alone(tmp_path, monkeypatch, started, calls):
    """The live run on the storage is another configuration's: the driver that found its local
    Ray leaves it (the run goes on); a Ray this fit() started for nothing is stopped."""
    trainer(tmp_path).claim_storage()                   # the live run
    fake = FakeRay(initialized=False, outcome=OUTCOME)
    fake.install(monkeypatch, local_started=started)
    with pytest.raises(RunConflictError):
        trainer(tmp_path).fit()
    assert [c for c in fake.calls if c != "kill"] == calls


def test_fit_sends_the_credentials_as_an_actor_argument_not_in_the_runtime_env(tmp_path, monkeypatch):
    from elastic._credentials import HIDDEN_STORAGE_ENV, SHOWN_STORAGE_ENV
    for name in HIDDEN_STORAGE_ENV + SHOWN_STORAGE_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "SUPERSECRET",
                        "AWS_SESSION_TOKEN": "SESSIONTOKEN", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    fake = FakeRay(outcome=OUTCOME)
    fake.install(monkeypatch)
    trainer(tmp_path).fit()
    shown = json.dumps(fake.options["runtime_env"])
    assert "us-east-1" in shown and not [s for s in ("AKIAEXAMPLE", "SUPERSECRET", "SESSIONTOKEN") if s in shown]
    spec = fake.args[0]
    assert spec.storage_env == {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "SUPERSECRET",
                                "AWS_SESSION_TOKEN": "SESSIONTOKEN"}

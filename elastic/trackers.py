"""Experiment trackers as callbacks: MLflow and Weights & Biases.

Both follow their library's own configuration when built with no arguments (MLflow:
`MLFLOW_TRACKING_URI`, `MLFLOW_EXPERIMENT_NAME`; W&B: `WANDB_PROJECT`, `WANDB_ENTITY`, `WANDB_MODE`,
`WANDB_API_KEY`, ...), and record:

- each kept step once (`Callback.kept_steps_only`: a tracker cannot take a point back, so a step
  reaches it once no recovery can take the step back), with every metric of its metrics.jsonl line
  at its step: the loss, the learning rate, the loop's metrics, and the framework's counts
  under `elastic/` (world_size, global_batch, accum_steps, samples_seen);
- each `ctx.log(...)` value at its step (validation);
- each recovery as `elastic/recovery_s` and `elastic/lost_steps` at the step training went on from;
- the run's configuration (flattened: `checkpoint.every_n_steps`, ...) once, when the tracker run
  is made;
- the end: MLflow's run status (FINISHED, KILLED for a requested stop, FAILED), W&B's exit code.

One tracker run per run storage: a resume (a new `fit()` on the same storage) goes on with the
same tracker run, found by the storage URL (MLflow: the run tagged `elastic.storage`; W&B: a run
id derived from it). A resume from storage redoes the steps after its checkpoint; those the
tracker has already are not sent again (it keeps their first attempt, trained from the same state
on the same samples).
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from elastic.callbacks import Callback
from elastic.errors import ConfigError

if TYPE_CHECKING:
    from elastic.result import Result

# A step line's keys that are no metric; the framework's counts, recorded under `elastic/`.
NOT_METRICS = ("format", "step", "time", "compute_s", "kind")
FRAMEWORK = ("world_size", "global_batch", "accum_steps", "samples_seen")
STORAGE_TAG = "elastic.storage"
RUN_ID_TAG = "elastic.run_id"


def metrics_of(line: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl line (a step's or a `ctx.log` one), by tracker name."""
    values = {}
    for name, value in line.items():
        if name in NOT_METRICS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        values[f"elastic/{name}" if name in FRAMEWORK and line.get("kind") is None else name] = float(value)
    return values


def recovery_metrics(recovery: dict[str, Any]) -> dict[str, float]:
    values = {"elastic/recovery_s": recovery.get("recover_s"), "elastic/lost_steps": recovery.get("lost_steps")}
    return {name: float(value) for name, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def flat_config(config: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The effective configuration as (dotted name, value) pairs: trackers' parameters are flat."""
    for name, value in config.items():
        if isinstance(value, dict):
            yield from flat_config(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def run_key(storage: str) -> str:
    """A tracker run's identity from the run's storage URL: the same across resumes."""
    return "elastic-" + hashlib.sha256(storage.encode()).hexdigest()[:16]


def _run_name(storage: str) -> str:
    return storage.rstrip("/").rsplit("/", 1)[-1] or storage


class MLflowCallback(Callback):
    """Records the run in MLflow (in the driver), through MLflow's client: any tracking URI, a
    server or a local store. `tracking_uri`, `experiment`: default to MLflow's environment
    (`MLFLOW_TRACKING_URI`, `MLFLOW_EXPERIMENT_NAME` or `MLFLOW_EXPERIMENT_ID`, else its default
    experiment). `run_name`: defaults to the storage's last path part. `tags`: set on the run.

    Needs MLflow's client: `pip install elastic-train[mlflow]` (mlflow-skinny; the full `mlflow`
    works as well)."""

    kept_steps_only = True
    BATCH = 1000        # MLflow's limit of metrics per log_batch call

    def __init__(self, tracking_uri: str | None = None, *, experiment: str | None = None,
                 run_name: str | None = None, tags: dict[str, str] | None = None):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as error:
            raise ConfigError("MLflowCallback needs MLflow's client: pip install elastic-train[mlflow]") from error
        self._client = MlflowClient(tracking_uri)
        self._experiment, self._run_name, self._tags = experiment, run_name, dict(tags or {})
        self.run_id: str | None = None       # MLflow's id of the run, once started
        self._logged_through = 0             # the newest step the MLflow run had when it was resumed
        self._pending: list[Any] = []        # metrics not sent yet (sent per batch of lines)

    def on_start(self, start_info: dict[str, Any]) -> None:
        storage = str(start_info.get("storage"))
        experiment_id = self._experiment_id()
        quoted = storage.replace("\\", "\\\\").replace("'", "\\'")
        found = self._client.search_runs([experiment_id], filter_string=f"tags.`{STORAGE_TAG}` = '{quoted}'",
                                         max_results=1, order_by=["attributes.start_time DESC"])
        if found:
            self.run_id = found[0].info.run_id
            self._client.update_run(self.run_id, status="RUNNING")
            history = self._client.get_metric_history(self.run_id, "loss")
            self._logged_through = max((metric.step for metric in history), default=0)
        else:
            run = self._client.create_run(experiment_id, run_name=self._run_name or _run_name(storage),
                                          tags={STORAGE_TAG: storage, **self._tags})
            self.run_id = run.info.run_id
            from mlflow.entities import Param
            params = [Param(name, str(value)[:6000]) for name, value in flat_config(start_info.get("config") or {})]
            for start in range(0, len(params), 100):     # MLflow's limit of params per call
                self._client.log_batch(self.run_id, params=params[start:start + 100])
        self._client.set_tag(self.run_id, RUN_ID_TAG, str(start_info.get("run_id")))

    def on_step(self, step_info: dict[str, Any]) -> None:
        if int(step_info["step"]) > self._logged_through:
            self._add(step_info, metrics_of(step_info))

    def on_log(self, log_info: dict[str, Any]) -> None:
        if int(log_info["step"]) > self._logged_through:
            self._add(log_info, metrics_of(log_info))

    def on_recovery(self, recovery: dict[str, Any]) -> None:
        self._add(recovery, recovery_metrics(recovery))
        self._send()

    def on_checkpoint(self, commit: dict[str, Any]) -> None:
        self._send()       # at least at every commit: the batches stay small

    def _add(self, line: dict[str, Any], values: dict[str, float]) -> None:
        from mlflow.entities import Metric
        time = line.get("time")
        millis = int(time * 1000) if isinstance(time, float) else 0
        step = int(line.get("step") or 0)
        self._pending += [Metric(name, value, millis, step) for name, value in values.items()]
        if len(self._pending) >= self.BATCH:
            self._send()

    def _send(self) -> None:
        if self.run_id is None:
            return
        while self._pending:
            batch, self._pending = self._pending[:self.BATCH], self._pending[self.BATCH:]
            self._client.log_batch(self.run_id, metrics=batch)

    def on_end(self, result: Result) -> None:
        self._send()
        if self.run_id is not None:
            status = {"finished": "FINISHED", "stopped": "KILLED"}.get(result.status, "FAILED")
            self._client.set_terminated(self.run_id, status=status)

    def _experiment_id(self) -> str:
        name = self._experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")
        experiment = self._client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else self._client.create_experiment(name)


class WandbCallback(Callback):
    """Records the run in Weights & Biases (in the driver). `project`, `entity` and every other
    `wandb.init` argument (`init_options`: mode, dir, group, tags, ...) default to W&B's
    environment (`WANDB_PROJECT`, `WANDB_ENTITY`, `WANDB_MODE`, ...). The W&B run's id is derived
    from the storage URL, so a resume goes on with the same run (`resume="allow"`).

    The x axis is the training step: each line is logged with `{"step": N}` and every metric is
    defined against it (`define_metric`), since a `ctx.log` line may come after later steps'.

    Needs `pip install elastic-train[wandb]`."""

    kept_steps_only = True

    def __init__(self, project: str | None = None, *, entity: str | None = None, **init_options: Any):
        try:
            import wandb
        except ImportError as error:
            raise ConfigError("WandbCallback needs wandb: pip install elastic-train[wandb]") from error
        self._wandb = wandb
        self._project, self._entity, self._options = project, entity, init_options
        self.run: Any = None
        self._logged_through = 0

    def on_start(self, start_info: dict[str, Any]) -> None:
        storage = str(start_info.get("storage"))
        options = {"name": _run_name(storage), **self._options}
        self.run = self._wandb.init(project=self._project, entity=self._entity, id=run_key(storage),
                                    resume="allow", config=dict(flat_config(start_info.get("config") or {})),
                                    **options)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        previous = self.run.summary.get("step")
        self._logged_through = int(previous) if isinstance(previous, (int, float)) else 0
        self.run.summary[RUN_ID_TAG] = str(start_info.get("run_id"))

    def on_step(self, step_info: dict[str, Any]) -> None:
        self._log(step_info, metrics_of(step_info))

    def on_log(self, log_info: dict[str, Any]) -> None:
        self._log(log_info, metrics_of(log_info))

    def on_recovery(self, recovery: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log({"step": int(recovery.get("step") or 0), **recovery_metrics(recovery)})

    def _log(self, line: dict[str, Any], values: dict[str, float]) -> None:
        step = int(line["step"])
        if self.run is not None and step > self._logged_through:
            self.run.log({"step": step, **values})

    def on_end(self, result: Result) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if result.ok else 1)

"""ElasticTrainer: the public entry point. Validates, starts the controller actor, waits.

The controller runs in its own Ray actor (no CPU reserved) and owns the worker actors, so the
workers share its fate: if the driver goes, the whole run goes with it and nothing is left behind.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from elastic._accumulation import CONSTANT_GLOBAL_BATCH, check_divisible
from elastic.callbacks import CallbackRunner, check_callbacks
from elastic.config import CheckpointConfig, FailureConfig, LRScalingConfig, ScalingConfig, to_jsonable
from elastic._protocol import RunSpec
from elastic.errors import ConfigError, StorageConfigError
from elastic.policies import FailurePolicy, ScalingPolicy

log = logging.getLogger("elastic.trainer")

_SECRET_WORDS = ("secret", "key", "token", "password")
# The standard variables that point any S3-compatible store; forwarded to the run's actors,
# which do not inherit what the driver set after its Ray was started.
_STORAGE_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE")


@dataclass(frozen=True)
class RunMetrics:
    """The loop's metrics over the kept steps (a step lost in a failure and redone counts once,
    with its redone value; a resumed run's include the steps before the resume, read back from
    metrics.jsonl): `loss`, `lr` (when the loop prepared an optimizer) and every metric it passed
    to `ctx.report` (rank mean) or `ctx.log`. A non-finite value is a float here (NaN for one read
    back as null).

    `last`: name -> the value at the newest step that has one (summary.json's `metrics`).
    `history`: name -> `[[step, value], ...]` in step order.
    """

    last: dict[str, float] = field(default_factory=dict)
    history: dict[str, list[list]] = field(default_factory=dict)


@dataclass
class Result:
    """Outcome of `ElasticTrainer.fit()`."""

    status: str                          # "finished" | "failed"
    final_step: int
    storage: str
    summary: dict[str, Any] = field(default_factory=dict)   # summary.json as written (strict JSON values)
    error: BaseException | None = None   # the user's exception (original type) or a typed ElasticError
    error_traceback: str | None = None
    metrics: RunMetrics = field(default_factory=RunMetrics)
    checkpoint: str | None = None        # URL of the newest committed checkpoint, <storage>/checkpoints/step_<step:08d>

    @property
    def ok(self) -> bool:
        return self.status == "finished"

    def raise_for_error(self) -> None:
        if self.error is not None:
            raise self.error


class ElasticTrainer:
    """Runs `train_loop(ctx)` on an elastic group of Ray actors until `total_steps`.

    Args:
        train_loop: called on every rank with a TrainContext (and `train_loop_config` if it takes
            two parameters); re-entered after every rescale.
        scaling, checkpoint, failure: see their dataclasses.
        lr: the LR rule across rescales, linear or constant global batch (None: the optimizer's LR
            is left alone and the global batch follows the world size).
        total_steps: optimizer steps of the whole run (a resumed run continues up to it).
        seed: seeds initial weights, data order and per-(step, rank) randomness.
        failure_policy, scaling_policy: decide on failures and resizes; defaults in elastic.policies.
        progress: called about once a second in the driver with a snapshot dict of the run.
        callbacks: driver-side hooks (subclasses of elastic.Callback, e.g. TensorBoardCallback):
            every step's metrics line, log line, recovery and commit, once each, then the Result.
    """

    def __init__(self, train_loop: Callable[..., Any], *, scaling: ScalingConfig, checkpoint: CheckpointConfig,
                 failure: FailureConfig | None = None, total_steps: int, seed: int = 0,
                 train_loop_config: Any = None, lr: LRScalingConfig | None = None,
                 failure_policy: FailurePolicy | None = None,
                 scaling_policy: ScalingPolicy | None = None,
                 progress: Callable[[dict[str, Any]], None] | None = None,
                 callbacks: list[Any] | tuple[Any, ...] | None = None):
        if not callable(train_loop):
            raise ConfigError(f"train_loop must be callable, got {type(train_loop).__name__}")
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ConfigError(f"total_steps must be an int >= 1, got {total_steps!r}")
        for name, value, cls in (("scaling", scaling, ScalingConfig), ("checkpoint", checkpoint, CheckpointConfig),
                                 ("failure", failure or FailureConfig(), FailureConfig)):
            if not isinstance(value, cls):
                raise ConfigError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
        if lr is not None and not isinstance(lr, LRScalingConfig):
            raise ConfigError(f"lr must be an LRScalingConfig, got {type(lr).__name__}")
        if lr is not None and lr.warmup_steps >= total_steps:
            raise ConfigError(f"LRScalingConfig.warmup_steps ({lr.warmup_steps}) must be shorter than the run "
                              f"(total_steps={total_steps}); shorten the warmup")
        if lr is not None and lr.mode == CONSTANT_GLOBAL_BATCH:
            check_divisible(lr.base_world_size, scaling.min_workers, scaling.max_workers)
        if checkpoint.storage.startswith("memory://"):
            raise StorageConfigError("CheckpointConfig.storage: memory:// is private to one process and the "
                                     "workers are separate processes; use a local path or s3://")
        self._train_loop = train_loop
        self.scaling, self.checkpoint, self.failure = scaling, checkpoint, failure or FailureConfig()
        self.total_steps, self.seed, self.train_loop_config = total_steps, seed, train_loop_config
        self.lr = lr
        self.failure_policy, self.scaling_policy = failure_policy, scaling_policy
        self._progress = progress
        self._callbacks = check_callbacks(callbacks)

    def effective_config(self) -> dict[str, Any]:
        config = {"scaling": to_jsonable(self.scaling), "checkpoint": to_jsonable(self.checkpoint),
                  "failure": to_jsonable(self.failure), "lr": to_jsonable(self.lr),
                  "total_steps": self.total_steps, "seed": self.seed}
        options = config["checkpoint"].get("storage_options") or {}
        config["checkpoint"]["storage_options"] = {
            k: ("***" if any(w in k.lower() for w in _SECRET_WORDS) else v) for k, v in options.items()}
        return config

    def _spec(self) -> RunSpec:
        c = self.checkpoint
        return RunSpec(user_code=self._pickled_user_code(), total_steps=self.total_steps,
                       seed=self.seed, strategy=self.scaling.strategy, use_gpu=self.scaling.use_gpu,
                       storage=c.storage, storage_options=dict(c.storage_options), checkpoint_every=c.every_n_steps,
                       keep=c.keep, async_save=c.async_save, max_consecutive_failures=c.max_consecutive_failures,
                       cpus_per_worker=self.scaling.cpus_per_worker,
                       collective_timeout_s=self.failure.collective_timeout_s, lr=self.lr, scaling=self.scaling,
                       on_nonfinite_loss=self.failure.on_nonfinite_loss)

    def _pickled_user_code(self) -> bytes:
        """The loop and its config as bytes for the workers (see RunSpec): pickled here, so an
        unpicklable config fails in `fit()` with its name rather than inside Ray."""
        try:
            return _dumps_user_code((self._train_loop, self.train_loop_config))
        except Exception as error:
            raise ConfigError(f"train_loop or train_loop_config cannot be pickled for the workers: "
                              f"{type(error).__name__}: {error}; pass picklable values (open files, "
                              f"locks and live connections belong inside the loop)") from error

    def _check_storage(self) -> None:
        from checkpointing.storage import Storage
        try:
            storage = Storage(self.checkpoint.storage, self.checkpoint.storage_options or None)
            storage.write_atomic(storage.path("status.json"),
                                 b'{"state": "scheduling", "generation": -1, "step": 0, "workers": []}')
        except Exception as error:
            raise StorageConfigError(f"CheckpointConfig.storage {self.checkpoint.storage!r} is not writable: "
                                     f"{error}; check the URL, credentials and endpoint") from error

    def fit(self) -> Result:
        """Run to completion; returns a Result (status "failed" carries the error, nothing is raised)."""
        import ray
        from elastic._controller_actor import ControllerActor

        self._check_storage()
        # The controller unpickles the policies: a user's policy class travels like the loop.
        for user_code in (self._train_loop, type(self.failure_policy), type(self.scaling_policy)):
            _ship_user_module_by_value(user_code)
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True)
        here = ray.get_runtime_context().get_node_id()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        storage_env = {k: os.environ[k] for k in _STORAGE_ENV if k in os.environ}
        actor = ray.remote(ControllerActor).options(
            num_cpus=0, max_concurrency=4, max_restarts=0,
            runtime_env={"env_vars": storage_env} if storage_env else None,
            # Beside the driver, hard: a soft preference was ignored on a CPU-less head node (seen
            # with ray.cluster_utils.Cluster), and the controller must not live on a node the
            # run may lose. If the driver's node goes, the run goes with it anyway.
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        ).remote(self._spec(), self.scaling, self.failure, self.checkpoint, self.total_steps,
                 self.effective_config(), self.failure_policy, self.scaling_policy, feed=bool(self._callbacks))
        done = actor.run.remote()
        runner = CallbackRunner(self._callbacks) if self._callbacks else None

        def events(after: int) -> list:
            return ray.get(actor.events.remote(after), timeout=30)

        try:
            while not ray.wait([done], timeout=1.0)[0]:
                if self._progress is not None:
                    try:
                        self._progress(ray.get(actor.snapshot.remote(), timeout=5))
                    except Exception:   # noqa: BLE001 - progress display is best effort
                        log.debug("progress snapshot failed", exc_info=True)
                if runner is not None:
                    try:
                        runner.poll(events)
                    except Exception:   # noqa: BLE001 - asked again next time: nothing is lost
                        log.debug("fetching the callbacks' events failed", exc_info=True)
            outcome = ray.get(done)
            if runner is not None:
                try:
                    runner.drain(events)
                except Exception:   # noqa: BLE001 - the run's outcome matters more
                    log.warning("the callbacks missed the run's last events (after event %d)", runner.delivered,
                                exc_info=True)
        finally:
            ray.kill(actor, no_restart=True)
        result = Result(status=outcome["status"], final_step=outcome["final_step"], storage=self.checkpoint.storage,
                        summary=outcome["summary"], error=outcome["error"], error_traceback=outcome["traceback"],
                        metrics=RunMetrics(**outcome["metrics"]),
                        checkpoint=newest_checkpoint(self.checkpoint.storage, outcome["summary"].get("checkpoints")))
        if runner is not None:
            runner.end(result)
        return result


def newest_checkpoint(storage: str, committed: list[int] | None) -> str | None:
    """The URL of the newest committed checkpoint, or None."""
    from elastic._run_record import checkpoint_url
    return checkpoint_url(storage, max(committed)) if committed else None


def _dumps_user_code(obj: Any) -> bytes:
    """cloudpickle, with every module of a ModuleType subclass pickled as that module's import.
    torch installs some config modules as instances of a subclass (e.g. `torch.distributed.config`);
    cloudpickle ships a by-value loop's submodules by reference only when their type is exactly
    ModuleType, so a loop that used `dist` and `ctx.config` could not be pickled."""
    import importlib
    import io
    import sys
    import types

    from ray import cloudpickle
    stand_ins = {id(m): name for name, m in list(sys.modules.items())
                 if isinstance(m, types.ModuleType) and type(m) is not types.ModuleType}

    class _Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            name = stand_ins.get(id(obj))
            if name is not None:
                return importlib.import_module, (name,)
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _ship_user_module_by_value(function: Callable[..., Any]) -> None:
    """Pickle the module of the user's loop (or policy class) by value when workers could not
    import it by name (a script beside the driver, a test file); installed packages still travel
    by reference."""
    import sys
    import sysconfig

    from ray import cloudpickle

    module = sys.modules.get(getattr(function, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    if module is None or module.__name__ == "__main__" or path is None:
        return
    installed = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not any(os.path.abspath(path).startswith(p) for p in installed | {os.path.join(project, "elastic")}):
        cloudpickle.register_pickle_by_value(module)

"""ElasticTrainer: the public entry point. Validates, starts the controller actor, waits.

The controller runs in its own Ray actor (no CPU reserved), and neither it nor the workers
belong to the driver's process: all are detached and named after the run
(elastic._run_names). When the controller's process dies, Ray restarts the actor
(CONTROLLER_RESTARTS times) and the new controller adopts the live workers
(elastic._controller.adoption); the driver's wait goes on with it. When the driver dies, the run
goes on to its end, on a cluster as on the local Ray fit() starts (elastic.local_ray); the same
fit() again attaches to it (`_attach`). Ctrl-C in fit() ends the
run; SIGTERM asks it to stop with a commit (`_stop_on_sigterm`).
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from elastic._credentials import mask_secrets, mask_text, mask_url, split_storage_env
from elastic._following import RunFollower
from elastic._protocol import RunSpec
from elastic.callbacks import check_callbacks
from elastic.config import (
    CONSTANT_GLOBAL_BATCH,
    LOG_LEVEL_ENV,
    CheckpointConfig,
    FailureConfig,
    LoggingConfig,
    LRScalingConfig,
    ScalingConfig,
    check_divisible,
    to_jsonable,
)
from elastic.errors import ConfigError, StorageConfigError
from elastic.local_ray import LocalRay, quiet_local_ray_auth
from elastic.local_ray import supported as local_ray_supported
from elastic.policies import FailurePolicy, ScalingPolicy
from elastic.result import Result
from elastic.schemas import dumps, status_doc

if TYPE_CHECKING:
    from checkpointing import RunConflictError
from elastic.stop_request import clear_stop

log = logging.getLogger("elastic.trainer")

# How often Ray restarts a lost controller within one fit(). Each restart adopts the run's live
# workers; a controller that keeps dying (its node's memory, a bug hit at every start) ends the run.
CONTROLLER_RESTARTS = 10


def actor_environment(environ: Mapping[str, str]) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The controller actor's runtime_env, and the credentials that go by RunSpec.storage_env.

    The standard AWS variables of the driver are forwarded to the run's actors, which do not
    inherit what the driver set after its Ray was started (the workers inherit the controller's
    runtime_env). Ray displays a runtime_env on its dashboard and writes it to its logs, so only
    the variables that are no secret go there (endpoint, region, profile); the credentials travel
    as an actor argument, which each actor puts in its own environment at its start."""
    shown, hidden = split_storage_env(environ)
    return ({"env_vars": shown} if shown else None), hidden


def _foreign_config(name: str, value: Any, cls: type) -> str:
    """The ConfigError message for a config of the wrong type: for Ray Train's configs (same
    names, other fields), the elastic config that says the same."""
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    message = f"{name} must be an elastic.{cls.__name__}, got {kind}"
    if not kind.startswith("ray."):
        return message
    if cls is ScalingConfig and hasattr(value, "num_workers"):
        n = getattr(value, "num_workers", None) or 1
        extra = ", use_gpu=True" if getattr(value, "use_gpu", False) else ""
        resources = getattr(value, "resources_per_worker", None)
        extra += f", resources_per_worker={dict(resources)!r}" if resources else ""
        return (f"{message} (Ray Train's). Write elastic.ScalingConfig(min_workers={n}, max_workers={n}{extra}): "
                f"the group is sized between min_workers and max_workers (a lower min_workers lets the run go "
                f"on after losses)")
    if cls is CheckpointConfig:
        keep = getattr(value, "num_to_keep", None)
        return (f"{message} (Ray Train's). Write elastic.CheckpointConfig(storage=URL"
                f"{f', keep={keep}' if keep else ''}, every_n_steps=N): the storage URL (Ray's "
                f"RunConfig.storage_path) and the checkpoint period belong to it")
    if cls is FailureConfig and hasattr(value, "max_failures"):
        failures = value.max_failures
        failures = None if failures is None or failures < 0 else failures
        return (f"{message} (Ray Train's). Write elastic.FailureConfig(max_failures={failures!r}) "
                f"(None is unlimited, not -1)")
    return f"{message} (a Ray config; elastic has its own)"


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
        progress: called about once a second in the driver with a snapshot dict of the run (step,
            total_steps, loss, world_size, generation, last_committed_step, state, failures,
            elapsed_s); its `close()`, if it has one, when the run ends. elastic.progress.ProgressDisplay
            shows a bar with steps/s and an ETA.
        callbacks: driver-side hooks (subclasses of elastic.Callback, e.g. TensorBoardCallback):
            every step's metrics line, log line, recovery and commit, once each, then the Result.
        logging_config: the level of elastic's loggers in the driver, the controller and the
            workers (None: as configured; the controller logs at INFO).
    """

    def __init__(self, train_loop: Callable[..., Any], *, scaling: ScalingConfig, checkpoint: CheckpointConfig,
                 failure: FailureConfig | None = None, total_steps: int, seed: int = 0,
                 train_loop_config: Any = None, lr: LRScalingConfig | None = None,
                 failure_policy: FailurePolicy | None = None,
                 scaling_policy: ScalingPolicy | None = None,
                 progress: Callable[[dict[str, Any]], None] | None = None,
                 callbacks: list[Any] | tuple[Any, ...] | None = None,
                 logging_config: LoggingConfig | None = None):
        if not callable(train_loop):
            raise ConfigError(f"train_loop must be callable, got {type(train_loop).__name__}")
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ConfigError(f"total_steps must be an int >= 1, got {total_steps!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        for name, value, cls in (("scaling", scaling, ScalingConfig), ("checkpoint", checkpoint, CheckpointConfig),
                                 ("failure", failure or FailureConfig(), FailureConfig)):
            if not isinstance(value, cls):
                raise ConfigError(_foreign_config(name, value, cls))
        if logging_config is not None and not isinstance(logging_config, LoggingConfig):
            raise ConfigError(f"logging_config must be an elastic.LoggingConfig, got {type(logging_config).__name__}")
        if lr is not None and not isinstance(lr, LRScalingConfig):
            raise ConfigError(f"lr must be an LRScalingConfig, got {type(lr).__name__}")
        if lr is not None and lr.warmup_steps >= total_steps:
            raise ConfigError(f"LRScalingConfig.warmup_steps ({lr.warmup_steps}) must be shorter than the run "
                              f"(total_steps={total_steps}); shorten the warmup")
        if lr is not None and lr.mode == CONSTANT_GLOBAL_BATCH:
            check_divisible(lr.base_world_size, scaling.min_workers, scaling.max_workers,
                            scaling.replica_size, scaling.unit_size // scaling.replica_size)
        if checkpoint.storage.startswith("memory://"):
            raise StorageConfigError("CheckpointConfig.storage: memory:// is private to one process and the "
                                     "workers are separate processes; use a local path or s3://")
        self._train_loop = train_loop
        self.scaling, self.checkpoint, self.failure = scaling, checkpoint, failure or FailureConfig()
        self.total_steps, self.seed, self.train_loop_config = total_steps, seed, train_loop_config
        self.lr = lr
        self.failure_policy, self.scaling_policy = failure_policy, scaling_policy
        self._progress = progress
        self.logging_config = logging_config
        self._callbacks = check_callbacks(callbacks)
        self._run_id: str | None = None     # this fit()'s, holding the storage's lease (see _check_storage)

    def effective_config(self) -> dict[str, Any]:
        """The configuration as plain JSON (summary.json's `config`), with no secret in it: every
        secret-named storage option masked at any depth, and no password in a URL."""
        config = {"scaling": to_jsonable(self.scaling), "checkpoint": to_jsonable(self.checkpoint),
                  "failure": to_jsonable(self.failure), "lr": to_jsonable(self.lr),
                  "total_steps": self.total_steps, "seed": self.seed}
        config["checkpoint"]["storage"] = mask_url(config["checkpoint"]["storage"])
        config["checkpoint"]["storage_options"] = mask_secrets(config["checkpoint"].get("storage_options") or {})
        return config

    def _spec(self, storage_env: dict[str, str] | None = None) -> RunSpec:
        """What every worker needs; `storage_env`: the credentials from `actor_environment`."""
        return RunSpec(user_code=self._pickled_user_code(), total_steps=self.total_steps, seed=self.seed,
                       scaling=self.scaling, checkpoint=self.checkpoint, failure=self.failure, lr=self.lr,
                       storage_env=dict(storage_env or {}))

    def _pickled_user_code(self) -> bytes:
        """The loop and its config as bytes for the workers (see RunSpec): pickled here, so an
        unpicklable config fails in `fit()` with its name rather than inside Ray."""
        try:
            return _dumps_user_code((self._train_loop, self.train_loop_config))
        except Exception as error:
            raise ConfigError(f"train_loop or train_loop_config cannot be pickled for the workers: "
                              f"{type(error).__name__}: {error}; pass picklable values (open files, "
                              f"locks and live connections belong inside the loop)") from error

    def claim_storage(self) -> None:
        """Take the storage for this run (one run per URL: RunConflictError names a live one),
        then write its first status.json: both prove the storage writable before anything
        starts. `fit()` does it first; call it yourself to be refused before starting Ray (a
        second `claim_storage()` or the `fit()` after it reuses the claim)."""
        if self._run_id is None:
            self._check_storage()

    def _check_storage(self) -> None:
        from checkpointing import RunConflictError, acquire_run_lease
        from checkpointing.storage import Storage
        run_id = uuid.uuid4().hex
        options = self.checkpoint.storage_options or None
        try:
            acquire_run_lease(self.checkpoint.storage, run_id, storage_options=options,
                              takeover=self.checkpoint.takeover)
            # Only a claim that held is reused: after a refusal, fit() must meet the live run again
            # (and attach to it) rather than start a second run beside it.
            self._run_id = run_id
            storage = Storage(self.checkpoint.storage, options)
            # A STOP is meant for the run that was live when it was written: one left by an
            # earlier run (that ended before it saw it, or was stopped by it) must not stop this
            # resume at once. Cleared once the lease is ours, before status.json says we run.
            clear_stop(storage)
            storage.write_atomic(storage.path("status.json"), dumps(
                status_doc("scheduling", generation=-1, step=0, workers=[], run_id=self._run_id)).encode())
        except RunConflictError:
            raise
        except Exception as error:
            raise StorageConfigError(f"CheckpointConfig.storage {mask_url(self.checkpoint.storage)!r} is not "
                                     f"writable: {mask_text(str(error))}; check the URL, credentials and "
                                     f"endpoint") from error

    def fit(self) -> Result:
        """Run to completion; returns a Result. What is wrong before the run starts (config,
        storage not writable, a live run of another configuration on the storage) raises; once it
        has started nothing is raised: a failed run, a lost controller included, is a Result with
        status "failed" and the typed error. A live run of this same configuration on the storage
        (its driver left) is attached to: fit() follows it and returns its Result. A Ray that
        fit() started itself (none was initialized) is the run's own (elastic.local_ray): it
        outlives a killed driver, the next fit() with the same storage finds it, and it is
        stopped once the run ended. A Ray the caller started is left running."""
        import ray

        from checkpointing import RunConflictError
        try:
            self.claim_storage()
            conflict = None
        except RunConflictError as error:
            conflict = error        # a live run: this fit() attaches to it if it is the same run
        # The controller unpickles the policies: a user's policy class travels like the loop.
        for user_code in (self._train_loop, type(self.failure_policy), type(self.scaling_policy)):
            _ship_user_module_by_value(user_code)
        end_ray = _start_ray(ray, self.checkpoint.storage)
        refused = False
        try:
            return self._run(ray) if conflict is None else self._attach(ray, conflict)
        except (RunConflictError, ConfigError):
            refused = conflict is not None      # the live run there is not this fit()'s to end
            raise
        finally:
            self._run_id = None          # a later fit() is a run of its own: it claims the storage again
            if end_ray is not None:
                try:
                    end_ray(refused)
                except Exception:   # the Result matters more
                    log.warning("could not shut down the Ray instance fit() started", exc_info=True)

    def _run(self, ray: Any) -> Result:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from elastic._controller.actor import ControllerActor
        from elastic._run_names import NAMESPACE, RunNames
        here = ray.get_runtime_context().get_node_id()
        runtime_env, credentials = actor_environment(os.environ)
        if self.logging_config is not None:
            # The driver's elastic loggers here; the controller's (and, through its runtime_env,
            # the workers') by the variable their processes read when they set up logging.
            logging.getLogger("elastic").setLevel(self.logging_config.level)
            runtime_env = runtime_env or {}
            runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), LOG_LEVEL_ENV: self.logging_config.level}
        started = time.time()
        actor = ray.remote(ControllerActor).options(
            # A lost controller's process is restarted in its place, and the driver's calls (its
            # run() included) are resubmitted to the new one (max_task_retries): see the module.
            num_cpus=0, max_concurrency=8, max_restarts=CONTROLLER_RESTARTS, max_task_retries=-1,
            runtime_env=runtime_env, name=RunNames(self._run_id).controller() if self._run_id else None,
            namespace=NAMESPACE, lifetime="detached" if self._run_id else None,
            # Beside the driver, hard: a soft preference was ignored on a CPU-less head node (seen
            # with ray.cluster_utils.Cluster), and the controller must not live on a node the
            # run may lose. If the driver's node goes, the run goes with it anyway.
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        ).remote(self._spec(storage_env=credentials), self.effective_config(), self.failure_policy,
                 self.scaling_policy, feed=bool(self._callbacks), run_id=self._run_id)
        return self._follower().follow(ray, actor, started)

    def _attach(self, ray: Any, conflict: RunConflictError) -> Result:
        """The storage is held by a live run (`conflict`, a RunConflictError): follow it to its
        end when it is this same run (its controller lives in this Ray and its configuration is
        this one), as if this fit() had started it. Otherwise the conflict is raised, saying why."""
        from checkpointing import RunConflictError
        from elastic._run_names import NAMESPACE, RunNames
        owner = conflict.owner
        if owner is None:
            raise conflict
        try:
            actor = ray.get_actor(RunNames(owner).controller(), namespace=NAMESPACE)
            theirs = ray.get(actor.config.remote(), timeout=30)
        except Exception:   # noqa: BLE001 - not in this Ray (another cluster, a driver's own local Ray)
            raise conflict from None
        ours = self.effective_config()
        if theirs != ours:
            differ = sorted(_differences(theirs, ours))
            raise RunConflictError(f"{conflict}. It is a different run: its configuration differs from this one in "
                                 f"{', '.join(differ)}. The same configuration attaches to the live run and "
                                 f"returns its Result; wait for it to end, stop it (`elastic stop "
                                 f"{mask_url(self.checkpoint.storage)}`), or use another storage",
                                 url=conflict.url, owner=owner) from None
        log.warning("the run %s on %s is live and has this configuration: following it to its end", owner,
                    mask_url(self.checkpoint.storage))
        self._run_id = owner
        return self._follower().follow(ray, actor, time.time())

    def _follower(self) -> RunFollower:
        """What follows the run this fit() started or attached to, to its end."""
        return RunFollower(storage=self.checkpoint.storage, storage_options=self.checkpoint.storage_options or None,
                           run_id=self._run_id, config=self.effective_config(), total_steps=self.total_steps,
                           progress=self._progress, callbacks=self._callbacks)

def _differences(theirs: Any, ours: Any, path: str = "") -> list[str]:
    """Where two configurations (plain JSON) differ, as dotted paths."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        return [d for key in sorted(set(theirs) | set(ours))
                for d in _differences(theirs.get(key), ours.get(key), f"{path}.{key}" if path else key)]
    return [] if theirs == ours else [f"{path} ({theirs!r} there, {ours!r} here)"]


def _start_ray(ray: Any, storage: str) -> Callable[[bool], None] | None:
    """Join the cluster in RAY_ADDRESS or start a local Ray, unless the caller already has one.
    Returns how fit() ends the Ray it joined or started (None: the caller's, left alone): called
    with whether a run there may still be live (this fit() was refused before following one).

    A local Ray is the run's own (elastic.local_ray), found again by the next fit() with the same
    storage, so that a killed driver leaves its run going; it is stopped when the run ended
    under this fit(), or by the run's controller when no driver saw the end."""
    if ray.is_initialized():
        return None
    address = os.environ.get("RAY_ADDRESS") or None
    if address is None and _starts_local_ray():
        if local_ray_supported():
            local = LocalRay(storage)
            address, started = local.connect()
            ray.init(address=address, include_dashboard=False, log_to_driver=True)

            def end(live: bool) -> None:
                ray.shutdown()
                if started or not live:
                    local.stop()
            return end
        quiet_local_ray_auth()
    ray.init(address=address, include_dashboard=False, log_to_driver=True)
    return lambda live: ray.shutdown()


def _starts_local_ray() -> bool:
    """Whether `ray.init()` with no address starts a new local Ray (rather than joining the one
    `ray start` recorded on this machine). Asked of Ray's own resolution (private API: False
    when it fails, which leaves Ray's notice as it was)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
        # None, as ray.init(address=None) passes it (Ray's annotation says str; its code takes None).
        return canonicalize_bootstrap_address(None) is None  # type: ignore[arg-type]
    except Exception:   # noqa: BLE001 - only a log line is at stake
        return False


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

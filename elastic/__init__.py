"""Elastic, fault-tolerant PyTorch training on Ray.

Public API::

    from elastic import ElasticTrainer, ScalingConfig, CheckpointConfig, FailureConfig

Everything not exported here is internal (modules prefixed with `_`).
"""
import importlib

from checkpointing import CheckpointError, CorruptCheckpointError, FencedError, RunConflictError, StorageError
from elastic.callbacks import Callback, TensorBoardCallback  # light: torch's writer is imported when one is made
from elastic.config import CheckpointConfig, FailureConfig, LoggingConfig, LRScalingConfig, ScalingConfig
from elastic.errors import (
    ConfigError,
    DatasetError,
    ElasticError,
    FailureRateError,
    InsufficientWorkersError,
    NonFiniteLossError,
    NoProgressError,
    RestoreRequiredError,
    StateError,
    StorageConfigError,
    TooManyFailuresError,
    UserCodeError,
    WorkerLostError,
)
from elastic.policies import Failure, FailureDecision, FailurePolicy, ResizeDecision, ScalingPolicy
from elastic.result import Result, RunMetrics
from elastic.trackers import MLflowCallback, WandbCallback  # light: mlflow and wandb are imported when one is made
from elastic.trainer import ElasticTrainer

# Imported on first use: these pull in torch (and pyarrow), which the controller's process,
# the CLI and a driver that only submits never need.
_LAZY = {"TrainContext": "elastic.context", "ParquetTokens": "elastic.datasets",
         "write_token_shards": "elastic.datasets", "read_corpus_marker": "elastic.datasets"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ElasticTrainer", "Result", "RunMetrics", "TrainContext", "Callback", "TensorBoardCallback",
    "MLflowCallback", "WandbCallback",
    "ScalingConfig", "CheckpointConfig", "FailureConfig", "LRScalingConfig", "LoggingConfig",
    "FailurePolicy", "ScalingPolicy", "Failure", "FailureDecision", "ResizeDecision",
    "ParquetTokens", "write_token_shards", "read_corpus_marker",
    "ElasticError", "ConfigError", "DatasetError", "StorageConfigError", "WorkerLostError",
    "InsufficientWorkersError", "TooManyFailuresError", "FailureRateError", "NoProgressError", "UserCodeError",
    "StateError", "RestoreRequiredError", "NonFiniteLossError",
    "CheckpointError", "StorageError", "CorruptCheckpointError", "FencedError", "RunConflictError",
]

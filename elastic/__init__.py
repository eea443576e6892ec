"""Elastic, fault-tolerant PyTorch training on Ray.

Public API::

    from elastic import ElasticTrainer, ScalingConfig, CheckpointConfig, FailureConfig

Everything not exported here is internal (modules prefixed with `_`).
"""
from elastic.config import CheckpointConfig, FailureConfig, LRScalingConfig, ScalingConfig
from elastic.context import TrainContext
from checkpointing import CheckpointError, CorruptCheckpointError, FencedError, StorageError
from elastic.datasets import ParquetTokens, read_corpus_marker, write_token_shards
from elastic.errors import (ConfigError, DatasetError, ElasticError, InsufficientWorkersError,
                            StorageConfigError, TooManyFailuresError, UserCodeError, WorkerLostError)
from elastic.policies import Failure, FailureDecision, FailurePolicy, ResizeDecision, ScalingPolicy
from elastic.trainer import ElasticTrainer, Result

__all__ = [
    "ElasticTrainer", "Result", "TrainContext",
    "ScalingConfig", "CheckpointConfig", "FailureConfig", "LRScalingConfig",
    "FailurePolicy", "ScalingPolicy", "Failure", "FailureDecision", "ResizeDecision",
    "ParquetTokens", "write_token_shards", "read_corpus_marker",
    "ElasticError", "ConfigError", "DatasetError", "StorageConfigError", "WorkerLostError",
    "InsufficientWorkersError", "TooManyFailuresError", "UserCodeError",
    "CheckpointError", "StorageError", "CorruptCheckpointError", "FencedError",
]

"""Config validation: every bad value is a typed error naming the field, before anything starts."""
import pickle

import pytest

from elastic import (
    CheckpointConfig,
    ConfigError,
    ElasticError,
    ElasticTrainer,
    FailureConfig,
    ScalingConfig,
    StorageConfigError,
    TooManyFailuresError,
    UserCodeError,
)

pytestmark = pytest.mark.timeout(30)


def loop(ctx):
    pass


@pytest.mark.parametrize("kwargs, field", [
    ({"min_workers": 3, "max_workers": 2}, "max_workers"),
    ({"min_workers": 0}, "min_workers"),
    ({"min_workers": 2, "strategy": "zero3"}, "strategy"),
    ({"resources_per_worker": {"CPU": -1}}, "resources_per_worker"),
    ({"startup_wait_s": -1}, "startup_wait_s"),
    ({"max_workers": 3, "spare_workers": -1}, "spare_workers"),
    ({"spare_workers": 1}, "spare_workers needs max_workers"),
])
def test_scaling_config_rejects(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ScalingConfig(**kwargs)


def test_scaling_defaults():
    config = ScalingConfig(min_workers=2)
    assert config.max_workers is None and config.strategy == "ddp" and config.cpus_per_worker == 1.0


@pytest.mark.parametrize("kwargs, field", [
    ({"storage": ""}, "storage"),
    ({"storage": "runs/x", "every_n_steps": 0}, "every_n_steps"),
    ({"storage": "runs/x", "keep": 0}, "keep"),
])
def test_checkpoint_config_rejects(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        CheckpointConfig(**kwargs)


@pytest.mark.parametrize("url", ["ftp://host/x", "gs://bucket/x", "hdfs://nn/x"])
def test_unsupported_storage_scheme(url):
    with pytest.raises(StorageConfigError, match="storage"):
        CheckpointConfig(storage=url)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_failures": -1}, "max_failures"),
    ({"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 0.5}, "heartbeat_timeout_s"),
    ({"collective_timeout_s": 0}, "collective_timeout_s"),
    ({"straggler_window": 2}, "straggler_window"),
    ({"straggler_threshold": 1.0}, "straggler_threshold"),
])
def test_failure_config_rejects(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        FailureConfig(**kwargs)


def test_trainer_rejects_before_any_actor_starts(tmp_path):
    scaling, checkpoint = ScalingConfig(min_workers=1), CheckpointConfig(storage=str(tmp_path))
    with pytest.raises(ConfigError, match="total_steps"):
        ElasticTrainer(loop, scaling=scaling, checkpoint=checkpoint, total_steps=0)
    with pytest.raises(ConfigError, match="train_loop"):
        ElasticTrainer("not a function", scaling=scaling, checkpoint=checkpoint, total_steps=1)
    with pytest.raises(StorageConfigError, match="memory://"):
        ElasticTrainer(loop, scaling=scaling, checkpoint=CheckpointConfig(storage="memory://x"), total_steps=1)
    with pytest.raises(ConfigError, match="scaling"):
        ElasticTrainer(loop, scaling={"min_workers": 1}, checkpoint=checkpoint, total_steps=1)


def test_unwritable_storage_fails_before_ray(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    trainer = ElasticTrainer(loop, scaling=ScalingConfig(min_workers=1),
                             checkpoint=CheckpointConfig(storage=str(blocker / "run")), total_steps=1)
    with pytest.raises(StorageConfigError, match="not writable"):
        trainer.fit()


def test_effective_config_hides_secrets(tmp_path):
    trainer = ElasticTrainer(loop, scaling=ScalingConfig(min_workers=1), total_steps=5, checkpoint=CheckpointConfig(
        storage="s3://bucket/run", storage_options={"key": "AKIA", "secret": "s3cr3t", "endpoint_url": "http://x"}))
    options = trainer.effective_config()["checkpoint"]["storage_options"]
    assert options == {"key": "***", "secret": "***", "endpoint_url": "http://x"}


@pytest.mark.parametrize("error", [ConfigError("bad field"), TooManyFailuresError("3 > 2"), UserCodeError("x")])
def test_errors_pickle_with_type_and_message(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and isinstance(copy, ElasticError)

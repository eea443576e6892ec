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
    ({"spare_workers": 1, "max_workers": ScalingConfig.UNLIMITED}, "spare_workers needs a bounded max_workers"),
    ({"min_workers": 2, "max_workers": "unlimited"}, r"max_workers must be .*ScalingConfig.UNLIMITED"),
])
def test_scaling_config_rejects(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ScalingConfig(**kwargs)


def test_scaling_defaults():
    config = ScalingConfig(min_workers=2)
    assert config.max_workers == 2 and config.strategy == "ddp" and config.cpus_per_worker == 1.0


def test_max_workers_defaults_to_min_workers_and_unlimited_is_spelled_out():
    # Not given: a fixed size, so no placement request stays pending for workers never asked for.
    assert ScalingConfig().max_workers == 1
    assert ScalingConfig(min_workers=3).max_workers == 3
    assert ScalingConfig(min_workers=2, spare_workers=1).max_workers == 2     # spares work with the default
    # Unlimited: the name, or None written out (the default is no longer None, so None is a choice).
    assert ScalingConfig.UNLIMITED is None
    assert ScalingConfig(min_workers=2, max_workers=ScalingConfig.UNLIMITED).max_workers is None
    assert ScalingConfig(min_workers=2, max_workers=None).max_workers is None
    assert ScalingConfig(min_workers=2, max_workers=5).max_workers == 5
    # The resolved bound is what a copy carries and what summary.json's config shows.
    import dataclasses

    from elastic.config import to_jsonable
    assert dataclasses.replace(ScalingConfig(min_workers=2), strategy="fsdp").max_workers == 2
    assert to_jsonable(ScalingConfig(min_workers=2))["max_workers"] == 2
    assert to_jsonable(ScalingConfig(max_workers=ScalingConfig.UNLIMITED))["max_workers"] is None
    assert "UNLIMITED" not in {f.name for f in dataclasses.fields(ScalingConfig)}     # a name, not a field


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


def test_logging_config_takes_a_level_name_in_any_case():
    from elastic.config import LoggingConfig
    assert LoggingConfig().level == "INFO" and LoggingConfig(level="warning").level == "WARNING"
    with pytest.raises(ConfigError, match="LoggingConfig.level must be one of"):
        LoggingConfig(level="LOUD")
    with pytest.raises(ConfigError, match="logging_config must be an elastic.LoggingConfig"):
        ElasticTrainer(loop, scaling=ScalingConfig(), total_steps=5, checkpoint=CheckpointConfig(storage="/tmp/x"),
                       logging_config="DEBUG")


def test_hsdp_needs_its_shard_size_and_counts_in_shard_groups():
    from elastic.config import ScalingConfig
    scaling = ScalingConfig(strategy="hsdp", hsdp_shard_size=2, tensor_parallel_size=2, min_workers=4,
                            max_workers=8, spare_workers=4)
    assert scaling.unit_size == 4
    assert ScalingConfig(min_workers=4, tensor_parallel_size=2).unit_size == 2
    assert ScalingConfig(strategy="fsdp", min_workers=3).unit_size == 1
    with pytest.raises(ConfigError, match="strategy='hsdp' needs hsdp_shard_size"):
        ScalingConfig(strategy="hsdp", min_workers=2)
    with pytest.raises(ConfigError, match="hsdp_shard_size=2 applies to strategy='hsdp' only"):
        ScalingConfig(strategy="fsdp", hsdp_shard_size=2, min_workers=2)
    with pytest.raises(ConfigError, match="hsdp_shard_size must be an int >= 1"):
        ScalingConfig(strategy="hsdp", hsdp_shard_size=0, min_workers=2)
    with pytest.raises(ConfigError, match=r"max_workers=6 is not a multiple of the unit size=4.*shard groups"):
        ScalingConfig(strategy="hsdp", hsdp_shard_size=2, tensor_parallel_size=2, min_workers=4, max_workers=6)
    with pytest.raises(ConfigError, match="spare_workers=2 is not a multiple"):
        ScalingConfig(strategy="hsdp", hsdp_shard_size=2, tensor_parallel_size=2, min_workers=4, spare_workers=2)
    with pytest.raises(ConfigError, match="grad_compression"):
        ScalingConfig(strategy="hsdp", hsdp_shard_size=2, min_workers=2, grad_compression="bf16")
    fsdp_options = ScalingConfig(strategy="hsdp", hsdp_shard_size=2, min_workers=2, fsdp_cpu_offload=True,
                                 fsdp_reshard_after_forward=False)
    assert fsdp_options.fsdp_cpu_offload


def test_a_constant_global_batch_under_hsdp_divides_by_whole_shard_groups_only():
    from elastic.config import check_divisible
    check_divisible(12, 4, 12, 2, 2)          # data-parallel degrees 2, 4, 6 (not 3 or 5)
    with pytest.raises(ConfigError, match=r"\[4\]"):
        check_divisible(6, 4, 12, 2, 2)

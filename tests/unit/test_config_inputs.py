"""Bad configuration that used to slip through (review F21): every one is now a ConfigError (or a
StorageConfigError) naming the field, never a bare TypeError nor a silently wrong run."""
import math
import os
import pathlib
from types import SimpleNamespace

import pytest

from elastic import (
    CheckpointConfig,
    ConfigError,
    ElasticTrainer,
    FailureConfig,
    LRScalingConfig,
    ScalingConfig,
    StorageConfigError,
)
from elastic.policies import FailureDecision, ResizeDecision

pytestmark = pytest.mark.timeout(30)


def loop(ctx):
    pass


@pytest.mark.parametrize("field", ["heartbeat_interval_s", "heartbeat_timeout_s", "collective_timeout_s",
                                   "rendezvous_timeout_s", "straggler_min_excess_s"])
@pytest.mark.parametrize("value", [math.inf, math.nan, "30", True])
def test_failure_timeouts_are_finite_numbers(field, value):
    with pytest.raises(ConfigError, match=f"FailureConfig.{field}"):
        FailureConfig(**{field: value})


def test_an_infinite_straggler_threshold_is_refused_none_turns_scoring_off():
    with pytest.raises(ConfigError, match="straggler_threshold"):
        FailureConfig(straggler_threshold=math.inf)
    assert FailureConfig(straggler_threshold=None).straggler_threshold is None


@pytest.mark.parametrize("cls, kwargs, field", [
    (ScalingConfig, {"min_workers": True}, "min_workers"),
    (ScalingConfig, {"min_workers": 2.0}, "min_workers"),
    (ScalingConfig, {"max_workers": 4.0}, "max_workers"),
    (ScalingConfig, {"max_workers": True}, "max_workers"),
    (ScalingConfig, {"max_workers": 3, "spare_workers": 1.5}, "spare_workers"),
    (ScalingConfig, {"max_workers": 3, "spare_workers": True}, "spare_workers"),
    (ScalingConfig, {"powersgd_rank": 2.0}, "powersgd_rank"),
    (ScalingConfig, {"startup_wait_s": math.inf}, "startup_wait_s"),
    (ScalingConfig, {"use_gpu": "yes"}, "use_gpu"),
    (CheckpointConfig, {"keep": True}, "keep"),
    (CheckpointConfig, {"keep": 2.0}, "keep"),
    (CheckpointConfig, {"every_n_steps": True}, "every_n_steps"),
    (CheckpointConfig, {"every_n_steps": 10.0}, "every_n_steps"),
    (CheckpointConfig, {"max_consecutive_failures": 2.5}, "max_consecutive_failures"),
    (CheckpointConfig, {"max_consecutive_failures": "3"}, "max_consecutive_failures"),
    (CheckpointConfig, {"async_save": "no"}, "async_save"),
    (CheckpointConfig, {"storage_options": [("key", "x")]}, "storage_options"),
    (FailureConfig, {"max_failures": 2.0}, "max_failures"),
    (FailureConfig, {"max_failures": True}, "max_failures"),
    (FailureConfig, {"straggler_window": 5.0}, "straggler_window"),
    (LRScalingConfig, {"base_world_size": True}, "base_world_size"),
    (LRScalingConfig, {"base_world_size": 4, "warmup_steps": 1.5}, "warmup_steps"),
    (LRScalingConfig, {"base_world_size": 4, "base_lr": "3e-4"}, "base_lr"),
    (LRScalingConfig, {"base_world_size": 4, "min_lr_ratio": math.nan}, "min_lr_ratio"),
])
def test_counts_are_ints_not_bools_or_floats_and_types_are_checked(cls, kwargs, field, tmp_path):
    if cls is CheckpointConfig:
        kwargs = {"storage": str(tmp_path), **kwargs}
    with pytest.raises(ConfigError, match=f"{cls.__name__}.{field}"):
        cls(**kwargs)


@pytest.mark.parametrize("resources, message", [
    ({"CPU": "2"}, r"resources_per_worker\['CPU'\]"),
    ({"CPU": math.inf}, r"resources_per_worker\['CPU'\]"),
    ({"CPU": -1}, r"resources_per_worker\['CPU'\]"),
    ({1: 1}, "resource name"),
    ("CPU=2", "resources_per_worker must be a dict"),
    ({"GPU": 1}, "use_gpu=True"),
])
def test_resources_per_worker(resources, message):
    with pytest.raises(ConfigError, match=message):
        ScalingConfig(resources_per_worker=resources)


def test_gpu_resources_go_with_use_gpu():
    assert ScalingConfig(use_gpu=True, resources_per_worker={"CPU": 2, "GPU": 0.5}).resources_per_worker["GPU"] == 0.5
    with pytest.raises(ConfigError, match="GPU=0"):
        ScalingConfig(use_gpu=True, resources_per_worker={"GPU": 0})


@pytest.mark.parametrize("cls, kwargs, message", [
    (ScalingConfig, {"num_workers": 4}, "min_workers=N, max_workers=N"),
    (ScalingConfig, {"min_worker": 2}, "did you mean min_workers"),
    (CheckpointConfig, {"storage": "/tmp/x", "num_to_keep": 2}, "keep=N"),
    (CheckpointConfig, {"storage_path": "/tmp/x"}, "storage=URL"),
    (CheckpointConfig, {}, "needs storage=..."),
    (FailureConfig, {"heartbeat_timeout": 5}, "did you mean heartbeat_timeout_s"),
    (LRScalingConfig, {}, "needs base_world_size=..."),
])
def test_unknown_or_missing_arguments_are_config_errors_that_say_what_to_write(cls, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        cls(**kwargs)


def test_positional_arguments_are_a_config_error():
    with pytest.raises(ConfigError, match="keyword arguments only"):
        ScalingConfig(4)
    with pytest.raises(ConfigError, match=r"CheckpointConfig\(storage=\.\.\.\)"):
        CheckpointConfig("/tmp/x")


def test_configs_still_copy_pickle_and_replace():
    import dataclasses
    import pickle
    config = ScalingConfig(min_workers=2, max_workers=4)
    assert pickle.loads(pickle.dumps(config)) == config
    assert dataclasses.replace(config, max_workers=3).max_workers == 3
    with pytest.raises(ConfigError, match="max_workers"):
        dataclasses.replace(config, max_workers=1)


def test_ray_trains_configs_get_a_translation():
    ray_scaling = type("ScalingConfig", (), {"__module__": "ray.train._internal.config", "num_workers": 4,
                                             "use_gpu": True, "resources_per_worker": None})()
    with pytest.raises(ConfigError, match=r"ScalingConfig\(min_workers=4, max_workers=4, use_gpu=True\)"):
        ElasticTrainer(loop, scaling=ray_scaling, checkpoint=CheckpointConfig(storage="/tmp/x"), total_steps=5)
    ray_failure = type("FailureConfig", (), {"__module__": "ray.train", "max_failures": -1})()
    with pytest.raises(ConfigError, match=r"FailureConfig\(max_failures=None\)"):
        ElasticTrainer(loop, scaling=ScalingConfig(), checkpoint=CheckpointConfig(storage="/tmp/x"),
                       failure=ray_failure, total_steps=5)


def test_the_real_ray_train_scaling_config_gets_the_translation():
    train = pytest.importorskip("ray.train")
    with pytest.raises(ConfigError, match=r"ScalingConfig\(min_workers=3, max_workers=3\)"):
        ElasticTrainer(loop, scaling=train.ScalingConfig(num_workers=3),
                       checkpoint=CheckpointConfig(storage="/tmp/x"), total_steps=5)


def test_trainer_counts_are_ints():
    for kwargs in ({"total_steps": True}, {"total_steps": 10.0}, {"total_steps": 5, "seed": 1.5}):
        with pytest.raises(ConfigError, match=next(iter(kwargs)) if "seed" not in kwargs else "seed"):
            ElasticTrainer(loop, scaling=ScalingConfig(), checkpoint=CheckpointConfig(storage="/tmp/x"), **kwargs)


def test_a_path_storage_is_accepted_and_a_relative_one_made_absolute(tmp_path, monkeypatch):
    assert CheckpointConfig(storage=tmp_path / "run").storage == str(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    assert CheckpointConfig(storage="runs/x").storage == str(tmp_path / "runs" / "x")
    assert CheckpointConfig(storage=pathlib.Path("runs/y")).storage == str(tmp_path / "runs" / "y")
    assert CheckpointConfig(storage="file://runs/z").storage == f"file://{tmp_path}/runs/z"
    assert CheckpointConfig(storage="~/runs").storage == os.path.expanduser("~/runs")
    for url in ("s3://bucket/runs/x", "file:///abs/x", "memory://x"):
        assert CheckpointConfig(storage=url).storage == url


@pytest.mark.parametrize("url, message", [
    ("s3://", "names no bucket"), ("s3:///runs/x", "names no bucket"),
    ("s3:/bucket/runs", "malformed scheme"), ("s3:bucket/runs", "malformed scheme"),
    ("s3://AKIA:secret@bucket/x", "never in the URL"),
])
def test_a_malformed_s3_url_is_a_storage_config_error(url, message):
    with pytest.raises(StorageConfigError, match=message) as raised:
        CheckpointConfig(storage=url)
    assert "secret@" not in str(raised.value)


@pytest.mark.parametrize("url", [None, "", "  ", 3])
def test_an_empty_or_mistyped_storage(url):
    with pytest.raises(ConfigError, match="CheckpointConfig.storage"):
        CheckpointConfig(storage=url)


def test_a_dataset_shorter_than_one_global_batch_is_refused():
    from elastic.config import check_dataset_covers_global_batch
    check_dataset_covers_global_batch(64, batch_size=8, world_size=4, accum_steps=2)     # exactly one
    with pytest.raises(ConfigError, match=r"63 samples, fewer than one global batch of 64.*at most 7"):
        check_dataset_covers_global_batch(63, batch_size=8, world_size=4, accum_steps=2)
    with pytest.raises(ConfigError, match="even batch_size=1 is too many"):
        check_dataset_covers_global_batch(3, batch_size=1, world_size=4)


@pytest.mark.parametrize("make, message", [
    (lambda: FailureDecision("retry", "x"), "FailureDecision.action"),
    (lambda: FailureDecision("fail", None), "FailureDecision.reason"),
    (lambda: ResizeDecision(-3, "x"), "ResizeDecision.target_world_size"),
    (lambda: ResizeDecision(0, "x"), "ResizeDecision.target_world_size"),
    (lambda: ResizeDecision(2.0, "x"), "ResizeDecision.target_world_size"),
    (lambda: ResizeDecision(True, "x"), "ResizeDecision.target_world_size"),
])
def test_policy_decisions_are_validated(make, message):
    with pytest.raises(ConfigError, match=message):
        make()
    assert FailureDecision("recover", "ok").action == "recover" and ResizeDecision(3, "ok").target_world_size == 3


def test_no_config_raises_a_bare_type_error():
    """Any wrong-typed value of any field: a ConfigError, never TypeError."""
    samples = [None, "x", 1.5, True, [], {}, SimpleNamespace(), math.inf]
    import dataclasses
    for cls, base in ((ScalingConfig, {}), (CheckpointConfig, {"storage": "/tmp/x"}), (FailureConfig, {}),
                      (LRScalingConfig, {"base_world_size": 2})):
        for f in dataclasses.fields(cls):
            for value in samples:
                try:
                    cls(**{**base, f.name: value})
                except ConfigError:
                    pass
                except Exception as error:     # noqa: BLE001
                    pytest.fail(f"{cls.__name__}({f.name}={value!r}) raised {type(error).__name__}: {error}")


# ---- every numeric field against generated values (review R3-9) -----------------------------------
CONFIGS = ((ScalingConfig, {}), (CheckpointConfig, {"storage": "/tmp/x"}), (FailureConfig, {}),
           (LRScalingConfig, {"base_world_size": 2}))
GENERATED = [math.inf, -math.inf, math.nan, 1e300, -1e300, 10**400, 1e10, -1, 0, 1, 0.5, "30", "", True, False,
             [1], None]


def _numeric_fields():
    import dataclasses
    import re
    for cls, base in CONFIGS:
        for f in dataclasses.fields(cls):
            # Annotations are strings here (the module's `from __future__ import annotations`).
            if re.search(r"\b(int|float)\b", str(f.type)) and not str(f.type).startswith("dict"):
                yield pytest.param(cls, base, f.name, id=f"{cls.__name__}.{f.name}")


def _usable(cls, name, value, config):
    """What a run does with an accepted value: a count is an int, a duration makes a wait's
    timeout and a timedelta, any other number is finite."""
    import datetime
    import threading
    if value is None or isinstance(value, str):
        return                                   # None (off, unlimited) and "auto" are the field's words
    assert not isinstance(value, bool), f"{cls.__name__}.{name}={value!r}: a bool was accepted as a number"
    if name.endswith("_s"):
        assert 0 <= value and math.isfinite(value), f"{cls.__name__}.{name}={value!r} accepted"
        datetime.timedelta(seconds=value)
        lock = threading.Lock()                  # free: acquire checks the timeout's range and returns
        assert lock.acquire(timeout=value)
        lock.release()
    elif isinstance(value, int):                 # numpy, torch and Ray hold a count as int64
        assert value < 2**63, f"{cls.__name__}.{name}={value!r} accepted"
    else:
        assert math.isfinite(value), f"{cls.__name__}.{name}={value!r} accepted"
    if isinstance(config, FailureConfig):        # and the bounds derived from the seconds fields
        for derived in (config.poll_hold_s, config.hang_timeout(1.0), config.step_timeout(1.0)):
            if derived is not None:
                datetime.timedelta(seconds=derived)


@pytest.mark.parametrize("cls, base, name", list(_numeric_fields()))
def test_every_numeric_field_takes_a_generated_value_or_refuses_it_with_a_config_error(cls, base, name):
    """Each generated value of each numeric field is either refused with a ConfigError naming
    the field, or accepted and usable (R3-9: collective_timeout_s=1e300 was accepted and
    overflowed torch's timedelta in the workers, where it read as the user's error)."""
    for value in GENERATED:
        try:
            config = cls(**{**base, name: value})
        except ConfigError as error:
            assert name in str(error), f"{cls.__name__}({name}={value!r}): {error}"
            continue
        except Exception as error:     # noqa: BLE001 - any other type is the defect this test looks for
            pytest.fail(f"{cls.__name__}({name}={value!r}) raised {type(error).__name__}: {error}")
        _usable(cls, name, value, config)


@pytest.mark.parametrize("field", ["collective_timeout_s", "heartbeat_timeout_s", "rendezvous_timeout_s",
                                   "failure_rate_window_s", "step_timeout_s", "hang_timeout_s"])
def test_a_timeout_past_what_a_wait_and_torch_take_is_refused_with_its_name(field):
    with pytest.raises(ConfigError, match=f"FailureConfig.{field} must be .* <= 1e\\+09"):
        FailureConfig(**{field: 1e300})
    from elastic.config import MAX_SECONDS
    assert getattr(FailureConfig(**{field: MAX_SECONDS}), field) == MAX_SECONDS
    with pytest.raises(ConfigError, match="ScalingConfig.startup_wait_s"):
        ScalingConfig(startup_wait_s=MAX_SECONDS * 2)

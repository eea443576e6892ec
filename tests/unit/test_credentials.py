"""No secret in what a run shows (summary.json's config, reprs, Ray's runtime_env), and the
credentials still reach every actor (review F10)."""
import json
import os

import pytest

from elastic import CheckpointConfig, ElasticTrainer, ScalingConfig

pytestmark = pytest.mark.timeout(30)

SECRETS = ("AKIAEXAMPLE", "SUPERSECRET", "SESSIONTOKEN", "pw123", "proxypw", "hunter2", "deep")


def loop(ctx):
    pass


def storage_options():
    return {
        "key": "AKIAEXAMPLE", "anon": False,
        "client_kwargs": {"aws_secret_access_key": "SUPERSECRET", "endpoint_url": "http://u:pw123@minio:9000",
                          "region_name": "eu-west-1", "Aws_Session_Token": "SESSIONTOKEN"},
        "config_kwargs": {"proxies": {"https": "http://proxyuser:proxypw@proxy:3128"},
                          "retries": {"max_attempts": 3}},
        "Password": "hunter2", "credentials": {"nested": "deep"},
    }


def test_effective_config_masks_secrets_at_any_depth_and_url_passwords():
    trainer = ElasticTrainer(loop, scaling=ScalingConfig(), total_steps=5, checkpoint=CheckpointConfig(
        storage="s3://bucket/run", storage_options=storage_options()))
    config = trainer.effective_config()
    text = json.dumps(config)
    assert not [s for s in SECRETS if s in text], text
    options = config["checkpoint"]["storage_options"]
    assert options["key"] == "***" and options["anon"] is False and options["Password"] == "***"
    assert options["credentials"] == "***"
    assert options["client_kwargs"] == {"aws_secret_access_key": "***", "endpoint_url": "http://u:***@minio:9000",
                                        "region_name": "eu-west-1", "Aws_Session_Token": "***"}
    assert options["config_kwargs"] == {"proxies": {"https": "http://proxyuser:***@proxy:3128"},
                                        "retries": {"max_attempts": 3}}
    assert trainer.checkpoint.storage_options["client_kwargs"]["aws_secret_access_key"] == "SUPERSECRET"  # unchanged


def test_the_repr_of_a_checkpoint_config_shows_no_secret():
    text = repr(CheckpointConfig(storage="s3://bucket/run", storage_options=storage_options()))
    assert "s3://bucket/run" in text and "eu-west-1" in text
    assert not [s for s in SECRETS if s in text], text


@pytest.mark.parametrize("url, shown", [
    ("http://u:pw@host", "http://u:***@host"),
    ("https://user:p%40ss@host:9000/path?q=1", "https://user:***@host:9000/path?q=1"),
    ("http://token@host/x", "http://***@host/x"),
    ("http://host:9000/a@b", "http://host:9000/a@b"),       # an @ in the path is no user-info
    ("s3://bucket/run", "s3://bucket/run"),
    ("/local/path", "/local/path"),
])
def test_mask_url(url, shown):
    from elastic._credentials import mask_url
    assert mask_url(url) == shown


def test_mask_secrets_keeps_none_and_non_secret_values():
    from elastic._credentials import mask_secrets
    assert mask_secrets({"key": None, "use_ssl": True, "list": ["http://a:b@h"]}) == \
        {"key": None, "use_ssl": True, "list": ["http://a:***@h"]}


ENVIRON = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "SUPERSECRET",
           "AWS_SESSION_TOKEN": "SESSIONTOKEN", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
           "AWS_ENDPOINT_URL_S3": "http://u:pw123@minio:9000", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_PROFILE": "dev", "HOME": "/root"}


def test_the_runtime_env_carries_no_secret_and_the_spec_carries_the_credentials(tmp_path):
    from elastic.trainer import actor_environment
    runtime_env, credentials = actor_environment(ENVIRON)
    shown = json.dumps(runtime_env)
    assert not [s for s in SECRETS if s in shown], shown
    assert runtime_env == {"env_vars": {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
                                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_PROFILE": "dev"}}
    assert credentials == {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "SUPERSECRET",
                           "AWS_SESSION_TOKEN": "SESSIONTOKEN", "AWS_ENDPOINT_URL_S3": "http://u:pw123@minio:9000"}
    trainer = ElasticTrainer(loop, scaling=ScalingConfig(), total_steps=5,
                             checkpoint=CheckpointConfig(storage=str(tmp_path)))
    spec = trainer._spec(storage_env=credentials)
    assert spec.storage_env == credentials
    assert not [s for s in SECRETS if s in repr(spec)]
    assert actor_environment({"HOME": "/root"}) == (None, {})


def test_a_worker_and_the_controller_set_the_credentials_before_storage_is_opened(tmp_path, monkeypatch):
    """The spec travels pickled as an actor argument; the worker's first use of it (loading the
    user's code) and the controller's constructor put the credentials in their environment."""
    from ray import cloudpickle

    from elastic.trainer import actor_environment
    _, credentials = actor_environment(ENVIRON)
    trainer = ElasticTrainer(loop, scaling=ScalingConfig(), total_steps=5,
                             checkpoint=CheckpointConfig(storage=str(tmp_path)))
    spec = cloudpickle.loads(cloudpickle.dumps(trainer._spec(storage_env=credentials)))
    for name in credentials:
        monkeypatch.setenv(name, "before")     # so that monkeypatch restores the environment after
        monkeypatch.delenv(name)
    spec.load_user_code()                                   # what TrainWorker.__init__ does first
    assert {k: os.environ.get(k) for k in credentials} == credentials

    import elastic._controller.actor as controller_actor
    for name in credentials:
        monkeypatch.delenv(name)
    seen = {}

    class Opened(Exception):
        pass

    class RecorderSeeingTheEnvironment:
        def __init__(self, *args, **kwargs):
            seen.update({k: os.environ.get(k) for k in credentials})
            raise Opened        # the first storage client of the controller: far enough

    monkeypatch.setattr(controller_actor, "RunRecorder", RecorderSeeingTheEnvironment)
    with pytest.raises(Opened):
        controller_actor.ControllerActor(spec, trainer.effective_config(), None, None)
    assert seen == credentials


# ---- R3-8: a wrapped error's text names the URL with its password --------------------------------
ENDPOINT_ERROR = 'Could not connect to the endpoint URL: "http://alice:hunter2@minio:9000/bucket/run/status.json"'


def test_r3_8_a_storage_that_is_not_writable_is_named_without_the_wrapped_errors_password(tmp_path, monkeypatch):
    """The trainer masked its own copy of the URL, then appended the wrapped error's raw text."""
    import checkpointing
    from elastic import StorageConfigError

    def unreachable(*args, **kwargs):
        raise OSError(ENDPOINT_ERROR)
    monkeypatch.setattr(checkpointing, "acquire_run_lease", unreachable)
    trainer = ElasticTrainer(loop, scaling=ScalingConfig(), total_steps=5,
                             checkpoint=CheckpointConfig(storage=str(tmp_path)))
    with pytest.raises(StorageConfigError) as raised:
        trainer.claim_storage()
    assert "hunter2" not in str(raised.value)
    assert "http://alice:***@minio:9000/bucket/run/status.json" in str(raised.value)


def test_r3_8_a_workers_error_reaches_status_json_without_the_url_password(tmp_path):
    """The worker's error report (status.json, summary.json) carries the traceback, whose cause
    chain holds the backend's own text."""
    from ray import cloudpickle

    from checkpointing import StorageError
    from elastic._protocol import RunSpec
    from elastic._worker.worker import TrainWorker
    from elastic.config import CheckpointConfig, FailureConfig, ScalingConfig
    spec = RunSpec(user_code=cloudpickle.dumps((loop, None)), total_steps=1, seed=0,
                   scaling=ScalingConfig(strategy="ddp", use_gpu=False),
                   checkpoint=CheckpointConfig(storage=str(tmp_path), keep=1,
                                               async_save=False, max_consecutive_failures=1),
                   failure=FailureConfig(collective_timeout_s=5.0))
    worker = TrainWorker(spec)
    try:
        try:
            raise OSError(ENDPOINT_ERROR)
        except OSError as cause:
            raise StorageError(f"write failed: {cause}") from cause
    except StorageError as error:
        worker._record_error(error)
    report = worker.poll()
    assert "alice:***@minio" in report.error_traceback and "alice:***@minio" in report.error_message
    assert "hunter2" not in report.error_traceback + report.error_message


def test_r3_8_the_run_processes_log_a_traceback_without_the_url_password():
    """A controller's or worker's log line that prints a traceback (`log.exception`) shows the
    wrapped backend error as the backend wrote it: their formatter masks the whole line."""
    import logging

    from elastic._credentials import MaskingFormatter
    from elastic.config import LOG_FORMAT
    try:
        try:
            raise OSError(ENDPOINT_ERROR)
        except OSError as cause:
            raise RuntimeError("status write failed") from cause
    except RuntimeError:
        import sys
        record = logging.LogRecord("elastic.controller", logging.ERROR, __file__, 1, "could not write %s",
                                   ("status.json",), sys.exc_info())
    line = MaskingFormatter(LOG_FORMAT).format(record)
    assert "could not write status.json" in line and "alice:***@minio:9000" in line and "hunter2" not in line

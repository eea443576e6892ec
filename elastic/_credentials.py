"""Credentials kept out of everything the run shows.

What a run shows: summary.json's `config`, status.json, log lines, and the `runtime_env` of its
actors, which Ray displays on its dashboard and writes to its logs in plain text. Storage options
are masked by key name at any depth and URLs lose their password (`http://u:***@host`). The AWS
secrets of the driver's environment reach the run's actors as a constructor argument
(`RunSpec.storage_env`, which Ray does not display), and each actor puts them in its own
environment before it opens storage; only the variables that are no secret (endpoint, region,
profile) travel in `runtime_env`.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

# Defined in checkpointing (which must not import elastic), shown from here to the runtime.
from checkpointing.masking import MASK as MASK
from checkpointing.masking import mask_text as mask_text
from checkpointing.masking import mask_url as mask_url

# A storage option whose key contains one of these (any case, any depth) is masked.
SECRET_WORDS = ("secret", "key", "token", "password", "credential")
# The standard variables that point a run at any S3-compatible store: those that are no secret ...
SHOWN_STORAGE_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE")
# ... and the credentials, which never go through runtime_env.
HIDDEN_STORAGE_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def is_secret_name(name: Any) -> bool:
    lowered = str(name).lower()
    return any(word in lowered for word in SECRET_WORDS)


def mask_secrets(value: Any) -> Any:
    """A copy of `value` (storage options, a config as plain JSON) fit to show: the value of every
    key that names a secret is masked, at any depth (client_kwargs, config_kwargs, ...), and
    every URL-like string loses its password. None stays None (an unset secret is no secret)."""
    if isinstance(value, Mapping):
        return {k: (MASK if is_secret_name(k) and v is not None else mask_secrets(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask_secrets(v) for v in value)
    if isinstance(value, str):
        return mask_url(value)
    return value


def split_storage_env(environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The driver's storage variables as (shown, hidden): `shown` may go in a runtime_env,
    `hidden` (the credentials, and an endpoint URL that carries a password) must not."""
    shown: dict[str, str] = {}
    hidden = {name: environ[name] for name in HIDDEN_STORAGE_ENV if name in environ}
    for name in SHOWN_STORAGE_ENV:
        if name in environ:
            value = environ[name]
            (shown if mask_url(value) == value else hidden)[name] = value
    return shown, hidden


def apply_env(env: Mapping[str, str]) -> None:
    """Set `env` in this process's environment (the driver's values win, as with runtime_env).
    Called by each actor at its start, before anything opens storage: botocore reads them when
    a client is made."""
    os.environ.update(env)


class MaskingFormatter(logging.Formatter):
    """The log lines of the run's own processes (controller, workers: Ray writes them to its log
    files and streams them to the driver) with every URL password masked: a message is masked
    where it is written, but a traceback a line prints (`log.exception`) shows each wrapped
    backend error as the backend wrote it, an endpoint URL with its password included."""

    def format(self, record: logging.LogRecord) -> str:
        return mask_text(super().format(record))


CREDENTIAL_LOGGERS = ("aiobotocore.credentials", "botocore.credentials")


def quiet_credential_notices() -> None:
    """botocore says where it found the credentials ("Found credentials in environment
    variables.", INFO) once per S3 client it makes: about 5 times per run in each process that
    opens the storage. Those notices go; its warnings and errors stay."""
    for name in CREDENTIAL_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)

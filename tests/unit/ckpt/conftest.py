"""Fixtures of the checkpointing unit tests: a fresh checkpoint URL per backend (no server)."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def memory_url():
    return f"memory://ckpt-{uuid.uuid4().hex[:10]}/run"


@pytest.fixture
def file_url(tmp_path):
    return str(tmp_path / "run")


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
    """A fresh checkpoint root on each backend that needs no server."""
    if request.param == "memory":
        return f"memory://ckpt-{uuid.uuid4().hex[:10]}/run"
    return str(tmp_path / "run")


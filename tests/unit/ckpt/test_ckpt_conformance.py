"""The conformance suite on memory:// and local files (the S3 run is in tests/integration)."""

from __future__ import annotations

import pytest

from ckpt_conformance import ConformanceSuite, test_errors_pickle_round_trip  # noqa: F401


class TestMemory(ConformanceSuite):
    @pytest.fixture
    def url(self, memory_url):
        return memory_url


class TestLocalFiles(ConformanceSuite):
    @pytest.fixture
    def url(self, file_url):
        return file_url

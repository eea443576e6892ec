"""The storage conformance suite against a real S3 endpoint (moto server over HTTP, via s3fs).

Credentials and endpoint come only from the standard AWS_* variables (no storage_options).
"""

from __future__ import annotations

import pytest

from ckpt_conformance import ConformanceSuite

pytestmark = pytest.mark.integration


class TestS3(ConformanceSuite):
    @pytest.fixture
    def url(self, s3_url):
        return s3_url

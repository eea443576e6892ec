"""Fixtures of the checkpointing integration tests: multi-process helpers and an S3 endpoint."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# ckpt_ranks.py / ckpt_rank_programs.py here, the shared conformance suite in the unit folder.
for p in (HERE, HERE.parents[1] / "unit" / "ckpt"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# The S3 endpoint fixtures (moto_endpoint, s3_env, s3_url) live in tests/integration/conftest.py.

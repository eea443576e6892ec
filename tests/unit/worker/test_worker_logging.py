"""A worker process's framework log lines carry times, and the user's own logging setup still
works: the handlers are the framework loggers' own, not the root's (worker._timestamped_framework_logs)."""
from __future__ import annotations

import re

import pytest

from support import fresh_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


# A fresh interpreter, as a Ray worker process is: the worker sets its logging up, then the
# user's module configures the root logger at INFO (a common first line of a training script).
_WORKER_THEN_USER = """
import logging
from elastic._worker.worker import _timestamped_framework_logs
_timestamped_framework_logs()
logging.basicConfig(level=logging.INFO, format="USER %(message)s")
logging.getLogger("elastic.worker").warning("rank 1 left generation 8")
logging.getLogger("checkpointing").warning("abandoning in-flight save")
logging.getLogger("my_loop").info("epoch 3")
"""


def test_framework_lines_carry_times_and_the_users_basicconfig_still_applies():
    out = fresh_python(_WORKER_THEN_USER, timeout_s=50)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    lines = out.stderr.decode().strip().splitlines()
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "
    assert re.match(stamp + r"elastic\.worker WARNING rank 1 left generation 8$", lines[0]), lines
    assert re.match(stamp + r"checkpointing WARNING abandoning in-flight save$", lines[1]), lines
    assert lines[2:] == ["USER epoch 3"]          # printed once each: nothing reaches the root twice

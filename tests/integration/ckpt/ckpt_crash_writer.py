"""Writer process for the crash test: commits step 1, then stops forever between the shard
writes of step 2 and its commit (after announcing it through a marker file), to be killed."""

import sys
import threading
from pathlib import Path

from checkpointing import CheckpointManager
from ckpt_conformance import make_state


def main() -> None:
    url, marker = sys.argv[1], Path(sys.argv[2])
    mgr = CheckpointManager(url, async_save=True)
    mgr.save(1, make_state(1), generation=0)
    assert mgr.wait() is not None

    def hang_before_commit() -> None:
        marker.write_text("shards written")
        threading.Event().wait()  # never returns: the test kills this process here

    mgr._before_commit = hang_before_commit
    mgr.save(2, make_state(2), generation=0)
    mgr.wait()


if __name__ == "__main__":
    main()

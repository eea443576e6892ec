"""The newest committed checkpoint while the run goes: found on a thread of its own, announced on
the controller's.

One role: `CommitWatch` owns "the newest committed step". It looks at the checkpoints on a
background thread (background_read.BackgroundRead, "commit-watch") every LIST_EVERY_S, and at
once after `wake()` (a transition): through the newest-commit hint, so that "nothing new" costs
one small GET, not a listing, and newest first in full every LATEST_EVERY_S (a checkpoint deleted
or found corrupt meanwhile). A listing that stalls stalls only this thread. The controller's
thread takes what it found (`take`: plain values) and announces the new commits (the run
record's `on_commits`, the callbacks' on_checkpoint); status.json gets the newest step as a value.
With `background=False` (as StatusWriter's), the looks are made inline instead, by `take` when
one is due: for a controller driven by tests with in-memory fakes.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from elastic._controller.background_read import BackgroundRead

if TYPE_CHECKING:
    from elastic._controller.collaborators import CheckpointView

log = logging.getLogger("elastic.controller")

LIST_EVERY_S = 2.0       # how often the newest commit is looked at (a small hint read, usually)
LATEST_EVERY_S = 30.0    # ... and listed in full, newest first


class CommitWatch:
    def __init__(self, checkpoints: CheckpointView, clock: Callable[[], float] = time.monotonic, *,
                 background: bool = True):
        self._checkpoints, self._clock = checkpoints, clock
        self._lock = threading.Lock()            # the found values: set by the reader, taken by the controller
        self._newest: int | None = None          # the newest committed step found
        self._found: list[int] = []              # commits found and not taken yet, oldest first
        # The reader thread's own: the newest commit found so far, and when it last listed in full.
        self._seen: int | None = None
        self._latest_at = -float("inf")
        self._reader = BackgroundRead("commit-watch", self.look, LIST_EVERY_S, None,
                                      what="the newest committed checkpoint") if background else None
        self._looked_at = -float("inf")          # inline: when `take` last looked

    def start(self) -> None:
        if self._reader is not None:
            self._reader.start()

    def wake(self) -> None:
        """Look again now (the run changed state: a commit may have just landed)."""
        if self._reader is not None:
            self._reader.wake()
        else:
            self._looked_at = -float("inf")

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    def take(self) -> tuple[int | None, list[int]]:
        """(the newest committed step, the commits found since the last take, oldest first). No
        storage call in the background mode: the controller's thread asks at every status write."""
        if self._reader is None and self._clock() - self._looked_at >= LIST_EVERY_S:
            self._looked_at = self._clock()
            try:
                self.look()
            except Exception:   # as the background reader: looked at again later
                log.debug("could not read the newest committed checkpoint", exc_info=True)
        with self._lock:
            found, self._found = self._found, []
            return self._newest, found

    def look(self) -> None:
        """One look at the checkpoints (on the reader's thread; a storage error passes up)."""
        now = self._clock()
        if self._seen is None or now - self._latest_at > LATEST_EVERY_S:
            # Newest first, stopping at the first valid manifest: O(1) reads however many
            # checkpoints are kept (never every manifest, even on the first look).
            self._latest_at = now
            latest = self._checkpoints.latest_step()
            first = self._seen is None
            with self._lock:
                self._newest = latest
                if first and latest is not None:
                    self._found.append(latest)
            if first:
                self._seen = latest
                return
        # The manifests of commits not seen yet (a small hint read when there are none).
        new = self._checkpoints.committed_since(self._seen)
        if new:
            self._seen = new[-1]
            with self._lock:
                self._newest = new[-1]
                self._found.extend(new)

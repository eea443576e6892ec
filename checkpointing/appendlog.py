"""One logical append-only file (a run's metrics.jsonl) on any storage, without rewriting the
whole object on every append.

Local files and memory:// append in place: `AppendLog` is then the plain file. Object stores
cannot append: rewriting the object at every flush costs O(n^2) bytes over a run. There the log
is a *base* object at `<path>` plus *segments* under `<path>.parts/`:

  <path>                          the base: every line up to segment `through`, one plain file
  <path>.parts/<a:012d>-<b:012d>  the lines of appends a..b (one PUT per append, `a == b`)
  <path>.parts/BASE               {"prev": {"through", "sha256"}, "next": {...}}: which segments
                                  the base holds (the entry whose sha256 matches the base)

An append is one small PUT. Segments are merged like a binary counter (two trailing segments
covering as many appends each are rewritten as one), so there are O(log n) of them and each
byte is rewritten O(log n) times; once the segments hold a quarter of the base's size they are
folded into the base (marker first, then base, then the segments are deleted), so the base is
rewritten O(1) times per byte. Every step is crash-safe: a reader resolves overlapping ranges to
the widest and ignores segments the base already holds, by the marker, so it never sees a line
twice or loses one. `compact()` folds everything into the base: after it (the writer calls it
when the run ends) `<path>` alone is the whole file, as the storage contract says.

During a run `<path>` lags the segments on object stores: read the log with `read()` (or
`read_log(storage, path)`), which presents the one file. One writer at a time (the run's
recorder); any number of readers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import threading
from typing import Any

from checkpointing.storage import Storage

log = logging.getLogger("checkpointing")

PARTS_SUFFIX = ".parts"
MARKER_NAME = "BASE"
_SEGMENT_RE = re.compile(r"^(\d{12})-(\d{12})$")
_EMPTY_SHA = hashlib.sha256(b"").hexdigest()


@dataclasses.dataclass(frozen=True)
class _Segment:
    a: int
    b: int
    name: str

    @property
    def span(self) -> int:
        return self.b - self.a + 1


def _segment_name(a: int, b: int) -> str:
    return f"{a:012d}-{b:012d}"


@dataclasses.dataclass
class _View:
    base: bytes
    through: int           # the base holds the lines of segments 1..through
    chain: list            # _Segment after `through`, in order, no overlaps
    garbage: list          # segment names covered by the base or by a wider segment
    max_seq: int           # highest sequence number any name or the marker used


class AppendLog:
    """Append-only log at `path` on `storage`; see the module docstring for the layout."""

    def __init__(self, storage: Storage, path: str, *, compact_ratio: float = 0.25,
                 min_compact_bytes: int = 256 << 10) -> None:
        self.storage = storage
        self.path = path
        self.parts = path + PARTS_SUFFIX
        self.segmented = not storage.appends_in_place
        self.compact_ratio = compact_ratio
        self.min_compact_bytes = min_compact_bytes
        self._lock = threading.Lock()
        self._state: _View | None = None  # the writer's view (base kept as size and hash only)
        self._base_size = 0
        self._base_sha = _EMPTY_SHA
        self._sizes: dict[str, int] = {}

    # ---- reading -----------------------------------------------------------------------------
    def read(self) -> bytes:
        """The whole log, as one file."""
        if not self.segmented:
            try:
                return self.storage.read_bytes(self.path)
            except FileNotFoundError:
                return b""
        for _ in range(5):
            view = self._scan()
            try:
                return view.base + b"".join(self.storage.read_bytes(f"{self.parts}/{s.name}")
                                            for s in view.chain)
            except FileNotFoundError:
                continue  # the writer merged or folded a segment meanwhile: look again
        raise FileNotFoundError(f"{self.path}: segments kept changing while reading")

    def _scan(self) -> _View:
        names = self.storage.listdir(self.parts)
        try:
            base = self.storage.read_bytes(self.path)
        except FileNotFoundError:
            base = b""
        through, marker_max = 0, 0
        if MARKER_NAME in names:
            try:
                marker = json.loads(self.storage.read_bytes(f"{self.parts}/{MARKER_NAME}"))
                digest = hashlib.sha256(base).hexdigest()
                nxt, prev = marker["next"], marker["prev"]
                marker_max = int(nxt["through"])
                if nxt["sha256"] == digest:
                    through = int(nxt["through"])
                elif prev["sha256"] == digest:
                    through = int(prev["through"])
                else:
                    # Rewritten by something that does not keep the marker: trust the base for
                    # everything the marker says it folded.
                    log.warning("%s does not match %s/%s; assuming it holds segments up to %d",
                                self.path, self.parts, MARKER_NAME, marker_max)
                    through = marker_max
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                log.warning("unreadable %s/%s: reading every segment after the base", self.parts, MARKER_NAME)
        widest: dict[int, _Segment] = {}
        garbage: list[str] = []
        max_seq = max(through, marker_max)
        for name in names:
            m = _SEGMENT_RE.match(name)
            if not m:
                continue
            seg = _Segment(int(m.group(1)), int(m.group(2)), name)
            max_seq = max(max_seq, seg.b)
            if seg.b <= through:
                garbage.append(name)
                continue
            best = widest.get(seg.a)
            if best is None or seg.b > best.b:
                if best is not None:
                    garbage.append(best.name)
                widest[seg.a] = seg
            else:
                garbage.append(name)
        chain: list[_Segment] = []
        cur = through
        while widest:
            following = widest.pop(cur + 1) if cur + 1 in widest else None
            if following is None:
                later = [s for s in widest.values() if s.a > cur]
                for s in [s for s in widest.values() if s.a <= cur]:  # inside a chosen one
                    garbage.append(s.name)
                    widest.pop(s.a)
                if not later:
                    break
                nxt = min(later, key=lambda s: s.a)
                log.warning("%s: segments %d..%d are missing", self.path, cur + 1, nxt.a - 1)
                cur = nxt.a - 1
                continue
            chain.append(following)
            cur = following.b
        return _View(base=base, through=through, chain=chain, garbage=garbage, max_seq=max_seq)

    # ---- writing -----------------------------------------------------------------------------
    def append(self, data: bytes) -> None:
        """Add `data` at the end: one PUT of a small object on object stores."""
        if not data:
            return
        if not self.segmented:
            self.storage.append(self.path, data)
            return
        with self._lock:
            st = self._writer_view()
            seq = st.max_seq + 1
            seg = _Segment(seq, seq, _segment_name(seq, seq))
            self.storage.write_atomic(f"{self.parts}/{seg.name}", data)
            st.max_seq = seq
            st.chain.append(seg)
            self._sizes[seg.name] = len(data)
            # The data is durable from here on: housekeeping that fails must not make the caller
            # write it again. It is redone from a fresh listing at the next append.
            try:
                self._merge_tail(st)
                tail = sum(self._sizes.get(s.name, 0) for s in st.chain)
                if tail >= max(self.min_compact_bytes, self.compact_ratio * self._base_size):
                    self._fold(st)
            except Exception as e:  # noqa: BLE001 - see above
                log.warning("merging the segments of %s failed (the append itself is stored): %s",
                            self.path, e)
                self._state = None

    def rewrite(self, data: bytes) -> None:
        """Replace the whole log by `data` (a resume truncating lines past its step)."""
        if not self.segmented:
            self.storage.write_atomic(self.path, data)
            return
        with self._lock:
            st = self._writer_view()
            self._write_base(st, data, through=st.max_seq)

    def compact(self) -> None:
        """Fold every segment into `<path>`, which is then the whole log as one plain file."""
        if not self.segmented:
            return
        with self._lock:
            st = self._writer_view()
            if st.chain or st.garbage:
                self._fold(st)

    def _writer_view(self) -> _View:
        if self._state is None:
            view = self._scan()
            self._base_size, self._base_sha = len(view.base), hashlib.sha256(view.base).hexdigest()
            view.base = b""  # the writer keeps no copy of the base
            self._sizes = {}
            for seg in view.chain:
                try:
                    self._sizes[seg.name] = self.storage.size(f"{self.parts}/{seg.name}")
                except FileNotFoundError:
                    self._sizes[seg.name] = 0
            self._state = view
        return self._state

    def _merge_tail(self, st: _View) -> None:
        while len(st.chain) >= 2 and st.chain[-1].span == st.chain[-2].span:
            left, right = st.chain[-2], st.chain[-1]
            merged = _Segment(left.a, right.b, _segment_name(left.a, right.b))
            data = b"".join(self.storage.read_bytes(f"{self.parts}/{s.name}") for s in (left, right))
            self.storage.write_atomic(f"{self.parts}/{merged.name}", data)
            st.chain[-2:] = [merged]
            self._sizes[merged.name] = len(data)
            for s in (left, right):  # covered by the merged one: readers ignore them meanwhile
                self._sizes.pop(s.name, None)
                self._delete(s.name)

    def _fold(self, st: _View) -> None:
        try:
            base = self.storage.read_bytes(self.path)
        except FileNotFoundError:
            base = b""
        data = base + b"".join(self.storage.read_bytes(f"{self.parts}/{s.name}") for s in st.chain)
        self._write_base(st, data, through=st.chain[-1].b if st.chain else st.through)

    def _write_base(self, st: _View, data: bytes, *, through: int) -> None:
        digest = hashlib.sha256(data).hexdigest()
        marker = {"format": 1, "prev": {"through": st.through, "sha256": self._base_sha},
                  "next": {"through": through, "sha256": digest}}
        # Marker first: whether the base below lands or not, a reader can tell which it is.
        self.storage.write_atomic(f"{self.parts}/{MARKER_NAME}", json.dumps(marker).encode())
        self.storage.write_atomic(self.path, data)
        old = [s.name for s in st.chain] + list(st.garbage)
        st.through, st.chain, st.garbage = through, [], []
        st.max_seq = max(st.max_seq, through)
        self._base_size, self._base_sha, self._sizes = len(data), digest, {}
        for name in old:
            self._delete(name)

    def _delete(self, name: str) -> None:
        try:
            self.storage.rm(f"{self.parts}/{name}", recursive=False)
        except Exception as e:  # noqa: BLE001 - a leftover segment is ignored by readers
            log.debug("could not delete %s/%s: %s", self.parts, name, e)


def read_log(storage: Storage | str, path: str | None = None, *,
             storage_options: dict[str, Any] | None = None) -> bytes:
    """The whole append log at `path` (base and segments), as one file; b"" if none.
    `storage`: a Storage (then `path` is a full path in it), or a run's URL, as the docs and the
    CLIs name runs (then `path` is relative to it: metrics.jsonl when left out)."""
    if isinstance(storage, str):
        storage = Storage(storage, storage_options)
        path = storage.path(path or "metrics.jsonl")
    elif path is None:
        raise TypeError("read_log(storage, path): with a Storage, give the log's path (storage.path(name))")
    return AppendLog(storage, path).read()

"""Storage access for checkpoints: the only module that imports fsspec/s3fs.

Everything else in `checkpointing` names locations by URL (`runs/x`, `file:///abs`, `memory://x`,
`s3://bucket/prefix`) and goes through `Storage`. This module decides how a URL maps to a
filesystem, which caches are off (commit markers must be read fresh: fsspec caches directory
listings and filesystem instances), how a small object is written atomically (S3 has no rename:
one PUT; local files: temp file + fsync + rename), and turns backend exceptions into `StorageError`.
"""

from __future__ import annotations

import os
import uuid
from typing import IO

from fsspec.core import split_protocol, url_to_fs

from checkpointing.errors import StorageError

_S3_PROTOCOLS = ("s3", "s3a")


def _fs_options(url: str, storage_options: dict | None) -> dict:
    opts = dict(storage_options or {})
    # A fresh instance per Storage: a cached instance carries a cached directory listing and,
    # for s3, credentials/endpoints of whoever created it first in this process.
    opts.setdefault("skip_instance_cache", True)
    opts.setdefault("use_listings_cache", False)
    protocol, _ = split_protocol(url)
    if protocol in _S3_PROTOCOLS:
        client_kwargs = opts.get("client_kwargs") or {}
        # botocore reads AWS_ENDPOINT_URL itself in recent versions; passing it explicitly keeps
        # older stacks (and AWS_ENDPOINT_URL_S3) working with no storage options at all.
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint_url" not in opts and "endpoint_url" not in client_kwargs:
            opts["endpoint_url"] = endpoint
        # botocore retries transient errors (throttling, 5xx, connection resets) with backoff;
        # "standard" mode covers more of them than the legacy default.
        config_kwargs = dict(opts.get("config_kwargs") or {})
        config_kwargs.setdefault("retries", {"max_attempts": 5, "mode": "standard"})
        opts["config_kwargs"] = config_kwargs
    return opts


class Storage:
    """One checkpoint root. Paths passed to methods are filesystem paths from `path()`."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        if not url:
            raise StorageError("empty storage URL: set CheckpointManager(url=...)", url=url)
        self.url = url.rstrip("/") or url
        self.storage_options = dict(storage_options or {})
        try:
            self.fs, root = url_to_fs(self.url, **_fs_options(self.url, storage_options))
        except (ImportError, ValueError, TypeError) as e:
            raise StorageError(
                f"cannot open storage {self.url!r}: {e}; check the URL scheme and storage_options",
                url=self.url,
            ) from e
        self.root = root.rstrip("/") or root
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.is_local = "file" in protocols or "local" in protocols

    # ---- paths -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *[p.strip("/") for p in parts if p]])

    def url_for(self, path: str) -> str:
        if self.is_local:
            return path
        return self.fs.unstrip_protocol(path)

    def _error(self, op: str, path: str, e: BaseException) -> StorageError:
        return StorageError(
            f"{op} {self.url_for(path)!r} failed: {type(e).__name__}: {e} "
            f"(storage {self.url!r}; check credentials/endpoint in storage_options or AWS_* variables)",
            url=self.url,
        )

    # ---- reads ---------------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        """Whole object, uncached. FileNotFoundError passes through unchanged."""
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise self._error("read", path, e) from e

    def open_read(self, path: str) -> IO[bytes]:
        try:
            return self.fs.open(path, "rb")
        except FileNotFoundError:
            raise
        except Exception as e:
            raise self._error("open", path, e) from e

    def exists(self, path: str) -> bool:
        try:
            self.fs.invalidate_cache(path)
            return self.fs.exists(path)
        except Exception as e:
            raise self._error("stat", path, e) from e

    def size(self, path: str) -> int:
        try:
            self.fs.invalidate_cache(path)
            return int(self.fs.size(path))
        except FileNotFoundError:
            raise
        except Exception as e:
            raise self._error("stat", path, e) from e

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) directly under `path`, read fresh; [] when it does not exist."""
        try:
            self.fs.invalidate_cache(path)
            entries = self.fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._error("list", path, e) from e
        base = path.rstrip("/")
        names = []
        for entry in entries:
            entry = entry.rstrip("/")
            if entry == base:
                continue
            names.append(entry.rsplit("/", 1)[-1])
        return sorted(set(names))

    def find(self, path: str) -> list[str]:
        """Every file under `path`, as paths relative to it."""
        try:
            self.fs.invalidate_cache(path)
            found = self.fs.find(path, withdirs=False)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._error("list", path, e) from e
        prefix = path.rstrip("/") + "/"
        return sorted(p[len(prefix):] for p in found if p.startswith(prefix))

    # ---- writes --------------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        # Object stores have no directories, and s3fs.makedirs would try to create a bucket.
        if self.is_local:
            try:
                self.fs.makedirs(path, exist_ok=True)
            except Exception as e:
                raise self._error("mkdir", path, e) from e

    def open_write(self, path: str) -> IO[bytes]:
        """A write stream; S3 uploads it (multipart for large files) when it is closed."""
        try:
            if self.is_local:
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            return self.fs.open(path, "wb")
        except Exception as e:
            raise self._error("open for write", path, e) from e

    def write_atomic(self, path: str, data: bytes) -> None:
        """Readers see the old object or the whole new one, never a torn one."""
        try:
            if self.is_local:
                parent = os.path.dirname(path)
                os.makedirs(parent, exist_ok=True)
                tmp = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
                _fsync_dir(parent)
            else:
                # A single PUT of a small object is atomic on S3 (and trivially in memory://).
                self.fs.pipe_file(path, data)
        except Exception as e:
            raise self._error("write", path, e) from e

    def append(self, path: str, data: bytes) -> None:
        """Add `data` at the end of the file (created if missing), without rewriting the rest.

        Local: one write of the whole chunk, then fsync (a reader may briefly see a torn last
        line). Object stores cannot append: the object is replaced by one holding the old and the
        new bytes (s3fs copies the old part server-side once it is over 5 MiB), so a reader sees
        the old or the new object.
        """
        try:
            if self.is_local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
            else:
                with self.fs.open(path, "ab") as f:
                    f.write(data)
        except Exception as e:
            raise self._error("append", path, e) from e

    def rm(self, path: str, recursive: bool = True) -> None:
        try:
            self.fs.invalidate_cache(path)
            if self.fs.exists(path):
                self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._error("delete", path, e) from e
        finally:
            self.fs.invalidate_cache(path)

    def fsync_file(self, stream: IO[bytes]) -> None:
        """Durability of a just-written local file; object stores are durable on close."""
        if self.is_local:
            stream.flush()
            fileno = getattr(stream, "fileno", None)
            if fileno is not None:
                os.fsync(fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


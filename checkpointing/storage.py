"""Storage access for checkpoints: the only module that imports fsspec/s3fs.

Everything else in `checkpointing` names locations by URL (`runs/x`, `file:///abs`, `memory://x`,
`s3://bucket/prefix`) and goes through `Storage`. This module decides how a URL maps to a
filesystem, which caches are off (commit markers must be read fresh: fsspec caches directory
listings and filesystem instances), how a small object is written atomically (S3 has no rename:
one PUT; local files: temp file + fsync + rename), and turns backend exceptions into `StorageError`,
naming the URL and its paths as `display_url` shows them (no password). `file:///` is the
filesystem root and `memory://` the memory store's root (trailing slashes go from the path only).

Conditional writes (`read_versioned` + `put_if`) are what make a commit or a fence update a
compare-and-swap rather than check-then-act:
  s3://      `If-None-Match: *` (create only) and `If-Match: <ETag>` (replace only that version) on
             the PUT. A store that ignores these headers, or refuses them (501, or a 400 that
             names the header), is found by a probe on first use and then gets check-then-put
             with a warning (the fence history still rejects a late commit from a fenced writer;
             see manifest.py). A probe that fails otherwise (an expired token, a timeout) decides
             nothing: it is raised and the next conditional write probes again.
  local      create: `os.link` of a fsynced temp file (fails if the name exists); replace: under an
             exclusive `flock` of a sidecar lock file, compare the content hash then `os.replace`.
  memory://  under a process-wide lock (memory:// is one process's dict).
  others     check-then-put, with a warning once per protocol.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from typing import IO

from fsspec.core import split_protocol, url_to_fs

from checkpointing.errors import StorageError
from checkpointing.masking import mask_text, mask_url

log = logging.getLogger("checkpointing")

_S3_PROTOCOLS = ("s3", "s3a")
_MEMORY_LOCK = threading.RLock()  # memory:// is a per-process dict: one lock makes its CAS atomic
_PROBED: dict[tuple, bool] = {}   # (endpoint, bucket) -> the S3 store honours conditional PUTs
_PROBE_LOCK = threading.Lock()
_WARNED: set = set()


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (create) or is not the version read (replace).

    Internal to the package: callers re-read and decide (a commit or fence update loops).
    """


def _chain(e: BaseException) -> Iterator[BaseException]:
    """The error, then its cause (or context), and so on, each once."""
    seen: set[int] = set()
    link: BaseException | None = e
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


# A 400 that answers the conditional header itself (`If-None-Match header is not supported`),
# not the request around it (ExpiredToken, RequestTimeout, AuthorizationHeaderMalformed: 400s too).
_NAMES_CONDITION = ("if-none-match", "if-match", "conditional")


def _refuses_header(e: BaseException) -> bool:
    """An S3-compatible store that refuses a conditional header outright: 501 NotImplemented, or
    a 400 whose error names the header. Any other error says nothing about the headers."""
    for link in _chain(e):
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            code = str(error.get("Code", ""))
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code == "NotImplemented" or status == 501:
                return True
            if status == 400 or code in ("InvalidArgument", "InvalidRequest"):
                said = " ".join(str(v) for v in error.values()).lower()
                if any(name in said for name in _NAMES_CONDITION):
                    return True
    return False


def content_token(data: bytes) -> str:
    """The version token of local and memory:// objects: their content hash."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _is_precondition_failure(e: BaseException) -> bool:
    """An S3 412 PreconditionFailed / 409 ConditionalRequestConflict, through s3fs's translation."""
    for link in _chain(e):
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            code = str((response.get("Error") or {}).get("Code", ""))
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412") or status in (409, 412):
                return True
    return False


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
        self.url = _without_trailing_slash(url)
        self.display_url = mask_url(self.url)   # as messages and logs show it: no password
        self.storage_options = dict(storage_options or {})
        try:
            self.fs, root = url_to_fs(self.url, **_fs_options(self.url, storage_options))
        except (ImportError, ValueError, TypeError) as e:
            raise StorageError(
                f"cannot open storage {self.display_url!r}: {e}; check the URL scheme and storage_options",
                url=self.url,
            ) from e
        self.root = root.rstrip("/") or root
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.is_local = "file" in protocols or "local" in protocols

    @property
    def process_local(self) -> bool:
        """Whether the storage lives in this process's memory (memory://): no other process sees it."""
        return self._is_memory()

    @property
    def appends_in_place(self) -> bool:
        """Whether `append` adds bytes without rewriting the object (local files, memory://);
        object stores rewrite it (see `checkpointing.appendlog.AppendLog` for a log that does not)."""
        return self.is_local or self._is_memory()

    # ---- paths -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        names = [p.strip("/") for p in parts if p]
        if not names:
            return self.root
        # The filesystem root ("/", "file:///") joins as "/x", not "//x".
        return "/".join([self.root if self.root != "/" else "", *names])

    def url_for(self, path: str) -> str:
        if self.is_local:
            return path
        return self.fs.unstrip_protocol(path)

    def display(self, path: str) -> str:
        """A path under this storage, or its URL (`url_for`), as messages and logs show it: under
        `display_url` when the URL has a password to hide, whichever way the backend maps URLs to
        paths (an HTTP path is the whole URL, memory:// keeps the user-info as text of the
        path); any other path as `url_for` names it, with every URL in it masked."""
        if self.display_url != self.url:
            for base in (self.root, self.url_for(self.root)):
                base = base.rstrip("/")
                if path == base or path.startswith(base + "/"):
                    return self.display_url + path[len(base):]
        return mask_text(self.url_for(path))

    def _error(self, op: str, path: str, e: BaseException) -> StorageError:
        # The backend's text may name the URL too (an endpoint, the key): masked like the rest.
        return StorageError(
            f"{op} {self.display(path)!r} failed: {type(e).__name__}: {mask_text(str(e))} "
            f"(storage {self.display_url!r}; check credentials/endpoint in storage_options or AWS_* variables)",
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
                tmp = _write_temp(path, data)
                try:
                    os.replace(tmp, path)
                except BaseException:
                    _unlink_quietly(tmp)
                    raise
                _fsync_dir(os.path.dirname(path))
            else:
                # A single PUT of a small object is atomic on S3 (and trivially in memory://).
                self.fs.pipe_file(path, data)
        except Exception as e:
            raise self._error("write", path, e) from e

    # ---- conditional writes (compare-and-swap) ----------------------------------------------
    def read_versioned(self, path: str) -> tuple[bytes, str]:
        """The whole object and its version token (S3: the ETag of that very GET; else a content
        hash), for a later `put_if`. FileNotFoundError passes through unchanged."""
        try:
            if self._is_s3():
                from fsspec.asyn import sync
                return sync(self.fs.loop, _s3_get_with_etag, self.fs, path)
            data = self.fs.cat_file(path)
            return data, content_token(data)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise self._error("read", path, e) from e

    def put_if(self, path: str, data: bytes, *, if_token: str | None) -> str | None:
        """Write `data` at `path` in one atomic step, only if the object is still as read.

        `if_token=None`: create only; the object must not exist. Otherwise: replace only the
        version whose token `read_versioned` returned. Raises PreconditionFailed when the
        condition does not hold (someone else wrote or deleted it first), StorageError on other
        failures. Returns the new version's token when the backend reports one.
        """
        try:
            if self.is_local:
                return self._put_if_local(path, data, if_token)
            if self._is_memory():
                with _MEMORY_LOCK:
                    self._check_token(path, if_token)
                    self.fs.pipe_file(path, data)
                    return content_token(data)
            if self._is_s3() and self._s3_conditional_ok():
                kwargs = {"mode": "create"} if if_token is None else {"IfMatch": if_token}
                try:
                    out = self.fs.pipe_file(path, data, **kwargs)
                except FileNotFoundError as e:
                    if if_token is None:
                        raise  # no such bucket: a storage error, not a lost race
                    raise PreconditionFailed(f"{path} is gone") from e  # If-Match on a deleted key
                except FileExistsError as e:
                    raise PreconditionFailed(f"{path} exists") from e
                except OSError as e:
                    if _is_precondition_failure(e):
                        raise PreconditionFailed(f"{path} changed") from e
                    raise
                return out.get("ETag") if isinstance(out, dict) else None
            self._warn_unconditional()
            self._check_token(path, if_token)
            self.fs.pipe_file(path, data)
            return None
        except PreconditionFailed:
            raise
        except Exception as e:
            raise self._error("conditional write", path, e) from e

    def _check_token(self, path: str, if_token: str | None) -> None:
        """Check-then-act half of a CAS (atomic only under the caller's lock)."""
        try:
            current = self.fs.cat_file(path)
        except FileNotFoundError:
            current = None
        if if_token is None and current is not None:
            raise PreconditionFailed(f"{path} exists")
        if if_token is not None:
            if current is None:
                raise PreconditionFailed(f"{path} is gone")
            if self._is_s3():
                etag = self.fs.info(path).get("ETag")
                if etag != if_token:
                    raise PreconditionFailed(f"{path} changed")
            elif content_token(current) != if_token:
                raise PreconditionFailed(f"{path} changed")

    def _put_if_local(self, path: str, data: bytes, if_token: str | None) -> str:
        import fcntl
        parent, name = os.path.split(path)
        os.makedirs(parent, exist_ok=True)
        lock_fd = os.open(os.path.join(parent, f".{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # flock: released by the kernel if this process dies (no stale lock files to expire).
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            tmp = _write_temp(path, data)
            try:
                if if_token is None:
                    try:
                        os.link(tmp, path)  # atomic create-if-absent, also on NFS
                    except FileExistsError as e:
                        raise PreconditionFailed(f"{path} exists") from e
                else:
                    try:
                        with open(path, "rb") as f:
                            current = f.read()
                    except FileNotFoundError as e:
                        raise PreconditionFailed(f"{path} is gone") from e
                    if content_token(current) != if_token:
                        raise PreconditionFailed(f"{path} changed")
                    os.replace(tmp, path)
            finally:
                _unlink_quietly(tmp)
            _fsync_dir(parent)
            return content_token(data)
        finally:
            os.close(lock_fd)  # closing the descriptor drops the flock

    def _is_s3(self) -> bool:
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        return any(p in _S3_PROTOCOLS for p in protocols)

    def _is_memory(self) -> bool:
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        return "memory" in protocols

    def _warn_unconditional(self, why: str = "") -> None:
        key = (self.url.split("://")[0], why)
        if key not in _WARNED:
            _WARNED.add(key)
            log.warning("storage %s has no conditional writes%s: commits and fence updates are "
                        "check-then-put (a fenced writer's late commit is still rejected by the fence "
                        "history, but can overwrite a manifest)", self.display_url, why)

    def _s3_conditional_ok(self) -> bool:
        """Whether this S3 store honours If-None-Match / If-Match on PUT; probed once per process
        and bucket (some S3-compatible stores ignore the headers and overwrite)."""
        bucket = self.root.split("/", 1)[0]
        endpoint = (getattr(self.fs, "endpoint_url", None)
                    or (getattr(self.fs, "client_kwargs", None) or {}).get("endpoint_url"))
        key = (endpoint, bucket)
        with _PROBE_LOCK:
            if key not in _PROBED:
                _PROBED[key] = self._probe_s3_conditional()  # raises (uncached) if inconclusive
                if not _PROBED[key]:
                    shown = mask_url(endpoint) if endpoint else "AWS"
                    self._warn_unconditional(f" (the S3 endpoint {shown} ignores If-None-Match "
                                             f"or If-Match on bucket {bucket!r})")
            return _PROBED[key]

    def _probe_s3_conditional(self) -> bool:
        """True/False when the store answered clearly; raises when the probe itself failed
        (a transient error must not switch the process to check-then-put for good). Clear
        answers: the headers are honoured (True), ignored (a second create or a wrong If-Match
        went through), or refused (`_refuses_header`). Anything else, an expired token or a
        timeout included, is raised, and the caller's next conditional write probes again."""
        probe = f"{self.root}/.conditional-write-probe-{uuid.uuid4().hex}"
        try:
            try:
                self.fs.pipe_file(probe, b"1", mode="create")
            except OSError as e:
                if _refuses_header(e):
                    return False  # e.g. 501 NotImplemented for If-None-Match
                raise
            try:
                self.fs.pipe_file(probe, b"2", mode="create")
                return False  # the second create went through: If-None-Match is ignored
            except OSError as e:
                if not (isinstance(e, FileExistsError) or _is_precondition_failure(e)):
                    if _refuses_header(e):
                        return False
                    raise
            try:
                self.fs.pipe_file(probe, b"3", IfMatch='"0123456789abcdef0123456789abcdef"')
                return False  # a PUT with a wrong If-Match went through
            except OSError as e:
                if not _is_precondition_failure(e):
                    if _refuses_header(e):
                        return False
                    raise
            return True
        finally:
            try:
                self.fs.rm(probe)
            except Exception:  # noqa: BLE001 - a leftover probe object is harmless
                pass

    def append(self, path: str, data: bytes) -> None:
        """Add `data` at the end of the file (created if missing), without rewriting the rest.

        Local: one write of the whole chunk, then fsync (a reader may briefly see a torn last
        line). Object stores cannot append: the object is replaced by one holding the old and the
        new bytes (s3fs copies the old part server-side once it is over 5 MiB), so a reader sees
        the old or the new object, and n appends cost O(n^2) bytes: for a growing log on an
        object store use `checkpointing.appendlog.AppendLog`.
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

    def rmdir_if_empty(self, path: str) -> None:
        """Remove an empty local directory (object stores have none); never a non-empty one."""
        if self.is_local:
            try:
                os.rmdir(path)
            except OSError:
                pass

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


def _without_trailing_slash(url: str) -> str:
    """`url` without trailing slashes on its path, and nothing else: `file:///` stays the
    filesystem root (stripped whole it became "file:", a relative path: the process's cwd) and
    `memory://` the memory store's root (not a local folder named "memory:")."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.rstrip("/") or url               # "/" stays the root
    stripped = rest.rstrip("/")
    if not stripped and rest:
        stripped = "/"                              # file:///, file:////: the root
    return f"{scheme}://{stripped}"


async def _s3_get_with_etag(fs, path: str) -> tuple[bytes, str]:
    bucket, key, _ = fs.split_path(path)
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    try:
        body = await resp["Body"].read()
    finally:
        resp["Body"].close()
    return body, resp["ETag"]


def _write_temp(path: str, data: bytes) -> str:
    """A fsynced temp file next to `path`; removed again if writing it fails."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as e:
        if e.errno != errno.ENOENT:
            log.debug("could not remove %s: %s", path, e)


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


"""A fault-injecting HTTP proxy in front of an S3-compatible endpoint.

The job under test talks to S3 through this proxy (its AWS_ENDPOINT_URL points here); the
proxy forwards every request unchanged (Host header included, so signatures still match what
the client signed) unless a fault is active:

  refuse(duration)   writes (PUT/POST/DELETE) are answered 503 SlowDown, as S3 does under
                     throttling or a partial outage; reads still work.
  hold(suffix)       writes to keys ending in `suffix` are held, not forwarded, until
                     `release(drop=...)`: dropped ones are answered 503 and never reach the
                     store (a commit lost with its writer), the others go through late.
  stall(duration)    every request, reads too, waits until the stall ends and then goes through,
                     as S3 stalls for tens of seconds; a client timing out first retries into
                     the same stall.

Every request is counted by outcome so the history shows that a fault really bit. Root can
write through any file mode, so refusing writes at the protocol level is the real mechanism.
"""
from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_WRITE_METHODS = ("PUT", "POST", "DELETE")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
               "proxy-authorization", "proxy-authenticate", "expect"}
_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
              b'<Message>chaos: storage outage, writes refused</Message></Error>')


class FaultProxy:
    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0):
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"FaultProxy upstream {upstream!r}: an http://host:port endpoint is needed")
        self.upstream = (parts.hostname, parts.port or 80)
        self._lock = threading.Condition()
        self._refuse_until = 0.0
        self._stall_until = 0.0
        self._hold_suffix: str | None = None
        self._held = 0
        self._release: str | None = None      # None while holding; "drop" or "forward" once released
        self.counts = {"forwarded": 0, "refused": 0, "held": 0, "dropped": 0, "stalled": 0, "errors": 0}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:   # quiet: the counters tell the story
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

        self._server = _QuietServer((host, port), Handler)
        self.endpoint = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="chaos-s3-proxy", daemon=True)
        self._thread.start()

    # ---- fault controls --------------------------------------------------------------------
    def refuse(self, duration_s: float) -> None:
        with self._lock:
            self._refuse_until = time.monotonic() + duration_s

    def stop_refusing(self) -> None:
        with self._lock:
            self._refuse_until = 0.0
        self._stall_until = 0.0

    def refusing(self) -> bool:
        return time.monotonic() < self._refuse_until

    def stall(self, duration_s: float) -> None:
        with self._lock:
            self._stall_until = time.monotonic() + duration_s

    def stop_stalling(self) -> None:
        with self._lock:
            self._stall_until = 0.0
            self._lock.notify_all()

    def _wait_out_stall(self) -> None:
        with self._lock:
            if time.monotonic() >= self._stall_until:
                return
            self.counts["stalled"] += 1
            while (left := self._stall_until - time.monotonic()) > 0:
                self._lock.wait(timeout=left)

    def hold(self, suffix: str) -> None:
        with self._lock:
            self._hold_suffix, self._held, self._release = suffix, 0, None

    def held_count(self) -> int:
        with self._lock:
            return self._held

    def wait_held(self, timeout_s: float) -> bool:
        """Whether a write matching the hold arrived within `timeout_s`."""
        with self._lock:
            return self._lock.wait_for(lambda: self._held > 0, timeout=timeout_s)

    def release(self, drop: bool) -> None:
        with self._lock:
            self._hold_suffix = None
            self._release = "drop" if drop else "forward"
            self._lock.notify_all()

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.counts)

    def close(self) -> None:
        self.release(drop=False)
        self.stop_refusing()
        self.stop_stalling()
        self._server.shutdown()
        self._server.server_close()

    # ---- request handling ------------------------------------------------------------------
    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        body = _read_body(req)
        path = urlsplit(req.path).path
        self._wait_out_stall()
        if req.command in _WRITE_METHODS:
            if self.refusing():
                self._count("refused")
                return _reply(req, 503, _SLOW_DOWN)
            with self._lock:
                held = self._hold_suffix is not None and path.endswith(self._hold_suffix)
                if held:
                    self._held += 1
                    self.counts["held"] += 1
                    self._lock.notify_all()
                    self._lock.wait_for(lambda: self._release is not None)
                    drop = self._release == "drop"
            if held and drop:
                self._count("dropped")
                return _reply(req, 503, _SLOW_DOWN, close=True)
        try:
            status, headers, payload = self._forward(req, body)
        except OSError as e:
            self._count("errors")
            return _reply(req, 502, f"chaos proxy: upstream error {e}".encode(), close=True)
        self._count("forwarded")
        req.send_response(status)
        for key, value in headers:
            if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                req.send_header(key, value)
        if req.command == "HEAD":
            length = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
            req.send_header("Content-Length", length)
            req.end_headers()
            return
        req.send_header("Content-Length", str(len(payload)))
        req.end_headers()
        req.wfile.write(payload)

    def _forward(self, req: BaseHTTPRequestHandler, body: bytes) -> tuple[int, list, bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in req.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            conn.request(req.command, req.path, body=body, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
            return resp.status, resp.getheaders(), payload
        finally:
            conn.close()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # Clients die mid-request on purpose here (killed workers): not worth a traceback.
        pass


def _read_body(req: BaseHTTPRequestHandler) -> bytes:
    if req.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks: list[bytes] = []
        while True:
            size = int(req.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while req.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass                      # trailers
                return b"".join(chunks)
            chunks.append(req.rfile.read(size))
            req.rfile.readline()
    length = int(req.headers.get("Content-Length") or 0)
    return req.rfile.read(length) if length else b""


def _reply(req: BaseHTTPRequestHandler, status: int, body: bytes, close: bool = False) -> None:
    req.send_response(status)
    req.send_header("Content-Type", "application/xml")
    req.send_header("Content-Length", str(len(body)))
    if close:
        req.send_header("Connection", "close")
        req.close_connection = True
    req.end_headers()
    req.wfile.write(body)

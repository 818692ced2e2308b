"""Local servers for the remote-source tests: moto's S3 in server mode and an HTTP server
in front of it or of a folder, which counts requests and injects faults.

Everything binds to 127.0.0.1 and is started and stopped by the tests' fixtures. The HTTP
server answers at most ``max_requests`` requests (then 500s), and injects at most
``faults.limit`` faults, never two in a row for one object, so every run that retries
completes.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import http.server
import os
import random
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Credentials the tests run under: distinctive, so that a leak is found by searching.
ACCESS_KEY = "AKIAFEATCACHE7TESTKEY"
SECRET_KEY = "fc-secret-9Qv2sL4xW7nB1mZ8"
BUCKET = "data"


@dataclass
class Faults:
    """Faults a server injects into GETs of object bodies, each with its probability."""

    unavailable: float = 0.0  # answer 503 Service Unavailable
    drop: float = 0.0  # send the headers and half the body, then close the connection
    forbidden: tuple[str, ...] = ()  # paths (substrings) answered 403 Access Denied
    seed: int = 0
    limit: int = 200  # faults injected at most
    injected: dict[str, int] = field(default_factory=lambda: {"503": 0, "drop": 0})

    def __post_init__(self) -> None:
        self.random = random.Random(self.seed)
        self.last_faulted: set[str] = set()

    def choose(self, key: str) -> str | None:
        """The fault for a GET of ``key`` (an object and range), or None."""
        if key in self.last_faulted or sum(self.injected.values()) >= self.limit:
            self.last_faulted.discard(key)
            return None
        draw = self.random.random()
        fault = None
        if draw < self.unavailable:
            fault = "503"
        elif draw < self.unavailable + self.drop:
            fault = "drop"
        if fault is not None:
            self.injected[fault] += 1
            self.last_faulted.add(key)
        return fault


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    status: int
    sent: int  # body bytes sent


class ObjectServer(http.server.ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1 serving ``folder``'s files (GET with ranges, HEAD,
    ETags), or forwarding every request to ``upstream`` (``host:port``, moto's S3)."""

    daemon_threads = True

    def __init__(
        self,
        folder: Path | None = None,
        upstream: str | None = None,
        faults: Faults | None = None,
        max_requests: int = 20_000,
    ) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.folder, self.upstream = folder, upstream
        self.faults = faults or Faults()
        self.max_requests = max_requests
        self.requests: list[Request] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def reads(self, name: str) -> list[Request]:
        """The successful GETs of paths ending in ``name``."""
        with self.lock:
            return [
                r
                for r in self.requests
                if r.method == "GET" and r.path.split("?")[0].endswith(name) and r.status < 300
            ]

    def count(self) -> int:
        with self.lock:
            return len(self.requests)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: ObjectServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _record(self, status: int, sent: int) -> None:
        with self.server.lock:
            self.server.requests.append(
                Request(self.command, self.path, self.headers.get("Range"), status, sent)
            )

    def do_GET(self) -> None:
        self._answer()

    def do_HEAD(self) -> None:
        self._answer()

    def do_PUT(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def do_DELETE(self) -> None:
        self._answer()

    def _answer(self) -> None:
        server = self.server
        if server.count() >= server.max_requests:
            self._send(500, {}, b"request limit reached")
            return
        faults = server.faults
        if any(p in self.path for p in faults.forbidden):
            body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            self._send(403, {"Content-Type": "application/xml"}, body)
            return
        fault = None
        if self.command == "GET" and "?" not in self.path:  # object bodies, not listings
            with server.lock:
                fault = faults.choose(f"{self.path} {self.headers.get('Range')}")
        if fault == "503":
            body = b"<Error><Code>ServiceUnavailable</Code><Message>Try again</Message></Error>"
            self._send(503, {"Content-Type": "application/xml"}, body)
            return
        status, headers, body = self._upstream() if server.upstream else self._file()
        if fault == "drop" and len(body) > 1:
            self._send(status, headers, body[: len(body) // 2], drop=True)
            return
        self._send(status, headers, body)

    def _send(self, status: int, headers: dict[str, str], body: bytes, drop: bool = False) -> None:
        self.send_response(status)
        for name, value in headers.items():
            if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(name, value)
        given = headers.get("Content-Length") or headers.get("content-length")
        keep = given is not None and (drop or self.command == "HEAD")
        self.send_header("Content-Length", str(given) if keep else str(len(body)))
        if drop:
            self.send_header("Connection", "close")
        self.end_headers()
        sent = 0
        if self.command != "HEAD":
            self.wfile.write(body)
            sent = len(body)
        self._record(status if not drop else 599, sent)
        if drop:
            self.wfile.flush()
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(2)

    def _upstream(self) -> tuple[int, dict[str, str], bytes]:
        host, port = str(self.server.upstream).split(":")
        length = int(self.headers.get("Content-Length") or 0)
        payload = self.rfile.read(length) if length else None
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            connection.request(self.command, self.path, body=payload, headers=headers)
            response = connection.getresponse()
            body = response.read()
            kept = {k: v for k, v in response.getheaders()}
            if self.command == "HEAD":
                kept["Content-Length"] = response.getheader("Content-Length") or "0"
            else:
                kept["Content-Length"] = str(len(body))
            return response.status, kept, body
        finally:
            connection.close()

    def _file(self) -> tuple[int, dict[str, str], bytes]:
        assert self.server.folder is not None
        relative = self.path.split("?")[0].lstrip("/")
        file = (self.server.folder / relative).resolve()
        if not file.is_file() or not file.is_relative_to(self.server.folder.resolve()):
            return 404, {"Content-Type": "text/plain"}, b"not found"
        data = file.read_bytes()
        etag = hashlib.md5(data).hexdigest()
        headers = {"ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if match is None:
            headers["Content-Length"] = str(len(data))
            return 200, headers, data
        start = int(match.group(1))
        end = min(int(match.group(2) or len(data) - 1), len(data) - 1)
        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        headers["Content-Length"] = str(end + 1 - start)
        return 206, headers, data[start : end + 1]


@contextlib.contextmanager
def serving(server: ObjectServer) -> Iterator[ObjectServer]:
    """``server`` answering on a thread until the block ends; then stopped and closed."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """moto's S3 in server mode on 127.0.0.1 with the bucket :data:`BUCKET`, under the
    test credentials (set in the environment for the block); yields ``host:port``."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in _CREDENTIAL_VARIABLES}
    os.environ.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_DEFAULT_REGION="us-east-1",
    )
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.pop("AWS_PROFILE", None)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        # moto keeps its buckets in the process: an earlier server's may still be there
        s3(f"{host}:{port}").makedirs(BUCKET, exist_ok=True)
        yield f"{host}:{port}"
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
)  # fmt: skip


def s3(endpoint: str) -> Any:
    """An s3fs filesystem on the S3 server at ``endpoint`` (``host:port``), for setting
    up test data (not the one featcache makes)."""
    import s3fs

    return s3fs.S3FileSystem(
        endpoint_url=f"http://{endpoint}", skip_instance_cache=True, use_listings_cache=False
    )


def upload(endpoint: str, folder: Path, prefix: str) -> str:
    """Every file under ``folder`` to ``s3://<bucket>/<prefix>/...``; returns that URL."""
    fs = s3(endpoint)
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        fs.pipe(f"{BUCKET}/{prefix}/{file.relative_to(folder).as_posix()}", file.read_bytes())
    return f"s3://{BUCKET}/{prefix}"

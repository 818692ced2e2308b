"""Files named by fsspec URLs: their filesystems, bounded retries and one-line errors
(see docs/guides/object-stores.md). Error lines never name credentials."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import inspect
import io
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO, TypeVar, cast

import torch

from featcache.errors import ConfigError, FeatcacheError, did_you_mean, first_line
from featcache.util.extras import install_command
from featcache.util.urls import WHERE_CREDENTIALS_GO, is_url, parent, protocol_of, scrub

T = TypeVar("T")

# Transient failures are retried RETRIES times, retry k + 1 after BACKOFF * 2**k seconds
# (jittered, at most BACKOFF_MAX).
RETRIES = 5
BACKOFF = 0.25
BACKOFF_MAX = 8.0

# Bytes fetched per request when a remote file is read sequentially (a shard's index).
BLOCK_SIZE = 16 << 20

# protocol -> the featcache extra that installs its fsspec implementation
PROTOCOL_EXTRAS: dict[str, str] = {
    **dict.fromkeys(("s3", "s3a"), "s3"),
    **dict.fromkeys(("gs", "gcs"), "gcs"),
    **dict.fromkeys(("az", "abfs", "abfss", "adl"), "azure"),
    **dict.fromkeys(("http", "https"), "http"),
    "hf": "hub",
}

# Retry counters by kind (a shared-memory tensor, so that DataLoader workers add to it).
RETRY_KINDS = ("server error", "throttled", "connection")

_TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}
_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests",
                   "RequestLimitExceeded", "429"}  # fmt: skip
_SERVER_CODES = {"ServiceUnavailable", "InternalError", "RequestTimeout", "500", "502", "503",
                 "504"}  # fmt: skip
# Exception classes (by name, so that no cloud library is imported to test for them)
# that mean the connection failed or broke off: aiohttp, botocore, urllib3, http.client.
_CONNECTION_ERRORS = {
    "ConnectionError", "TimeoutError", "IncompleteRead", "ClientPayloadError",
    "ServerDisconnectedError", "ClientConnectionError", "ClientOSError", "ServerTimeoutError",
    "ConnectionClosedError", "EndpointConnectionError", "ReadTimeoutError",
    "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError", "FSTimeoutError",
    "ProtocolError", "RemoteDisconnected", "ContentLengthError", "ShortRead",
}  # fmt: skip
_CONNECTION_ERRNOS = {errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED,
                      errno.ETIMEDOUT, errno.EPIPE, errno.EHOSTUNREACH}  # fmt: skip
# Exception classes (by name) that mean no credentials were found: botocore's, google-auth's.
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "DefaultCredentialsError"}  # fmt: skip
# The TypeError of a storage option that a filesystem (or the library under it) does not take.
_UNEXPECTED_OPTION = re.compile(r"unexpected keyword argument '([^']+)'")
# Options of the S3 client itself, which s3fs takes in its client_kwargs, not its own.
_S3_CLIENT_OPTIONS = ("region_name", "endpoint_url", "verify", "api_version")


class ShortRead(OSError):
    """A read returned fewer bytes than asked: the connection broke off mid-body."""


class RemoteError(FeatcacheError):
    """A remote read failed for good; the line names the URL and the fix."""


class Remote:
    """The fsspec filesystems of a source's URLs, with ``data.storage_options`` (for every
    protocol, or per protocol: ``{"s3": {...}}``). Filesystems are made in the process
    that reads (fsspec's async ones are not fork-safe), so a :class:`Remote` pickles into
    DataLoader workers; ``retried`` counts every process's retries, by :data:`RETRY_KINDS`.
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self.retried = torch.zeros(len(RETRY_KINDS), dtype=torch.int64).share_memory_()

    def options(self, protocol: str) -> dict[str, Any]:
        """The filesystem options for ``protocol``; for S3 with the libraries' own retry
        loops cut to one attempt (ours counts and bounds them)."""
        given = self.storage_options
        if given and all(k in PROTOCOL_EXTRAS or _known_protocol(k) for k in given):
            chosen = dict(given.get(protocol) or {})
        else:
            chosen = dict(given)
        if protocol in ("s3", "s3a"):
            config = dict(chosen.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})
            chosen["config_kwargs"] = config
        return chosen

    def fs(self, url: str) -> Any:
        """The filesystem of ``url``'s protocol (this process's own); FeatcacheError
        naming the extra when its fsspec implementation is not installed."""
        protocol = protocol_of(url)
        try:
            import fsspec
        except ImportError:
            raise FeatcacheError(_missing(protocol, "fsspec")) from None
        try:
            fs = fsspec.filesystem(protocol, **self.options(protocol))
        except ImportError as exc:
            raise FeatcacheError(_missing(protocol, first_line(exc))) from None
        except ValueError as exc:  # "Protocol not known"
            raise ConfigError(f"{protocol}:// is not a protocol fsspec knows ({exc})") from None
        except TypeError as exc:
            self._check_option(protocol, exc)
            raise
        if protocol in ("s3", "s3a"):
            fs.retries = 1  # s3fs's own loop (a class setting): one attempt, ours counts
        return fs

    def url(self, like: str, path: str) -> str:
        """The URL of a filesystem ``path`` (as a listing gives it), of ``like``'s protocol."""
        return path if is_url(path) else f"{protocol_of(like)}://{path}"

    def call(self, url: str, action: Callable[[Any, str], T]) -> T:
        """``action(fs, path)`` for ``url``, retried while it fails transiently; RemoteError
        (one line naming ``url``) for a permanent failure or :data:`RETRIES` transient ones."""
        fs = self.fs(url)
        path = fs._strip_protocol(url)
        for attempt in range(RETRIES + 1):
            try:
                return action(fs, path)
            except FeatcacheError:
                raise
            except Exception as exc:
                self._check_option(protocol_of(url), exc)
                kind = transient_kind(exc)
                if kind is None or attempt == RETRIES:
                    raise RemoteError(_failure(url, exc, attempt + 1, kind)) from None
                self.retried[RETRY_KINDS.index(kind)] += 1
                delay = min(BACKOFF * 2**attempt, BACKOFF_MAX)
                time.sleep(delay * random.uniform(0.5, 1.0))
                fs.invalidate_cache(path)
        raise AssertionError("unreachable")

    def read(self, url: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes of ``url`` (``[start, end)`` when given: one range request)."""

        def fetch(fs: Any, path: str) -> bytes:
            data = bytes(fs.cat_file(path, start=start, end=end))
            if start is not None and end is not None and len(data) != end - start:
                if len(data) >= end:
                    return data[start:end]  # a server that ignores ranges sends it all
                raise ShortRead(f"got {len(data)} of {end - start} bytes")
            return data

        return self.call(url, fetch)

    def read_many(self, urls: list[str]) -> list[bytes | FeatcacheError]:
        """The bytes of each of ``urls``, fetched concurrently; a URL that fails is read
        again on its own (retried), and a failure for good comes back in its place."""
        got: list[Any] = [None] * len(urls)
        if len({protocol_of(u) for u in urls}) == 1:  # else each is read on its own
            fs = self.fs(urls[0])
            paths = [fs._strip_protocol(u) for u in urls]
            with contextlib.suppress(Exception):  # then each is read on its own
                got = fs.cat_ranges(paths, None, None, on_error="return")
        out: list[bytes | FeatcacheError] = []
        for url, data in zip(urls, got, strict=True):
            if isinstance(data, (bytes, bytearray)):
                out.append(bytes(data))
                continue
            if isinstance(data, BaseException) and transient_kind(data) is None:
                out.append(RemoteError(_failure(url, data, 1, None)))
                continue
            if isinstance(data, BaseException):
                self.retried[RETRY_KINDS.index(str(transient_kind(data)))] += 1
            try:
                out.append(self.read(url))
            except ConfigError:
                raise  # the options, not this object: every read fails alike
            except FeatcacheError as exc:
                out.append(exc)
        return out

    def info(self, url: str, missing_ok: bool = False) -> dict[str, Any] | None:
        """fsspec's details of the object ``url`` (``size``, and an ETag where the store
        has one); None for a missing object when ``missing_ok``."""

        def info(fs: Any, path: str) -> dict[str, Any] | None:
            try:
                return dict(fs.info(path))
            except FileNotFoundError:
                if missing_ok:
                    return None
                raise

        return self.call(url, info)

    def stat(self, urls: list[str], missing_ok: bool = False) -> list[dict[str, Any]]:
        """:meth:`info` of each of ``urls``, from one listing per folder (HTTP: one request
        each); a missing object is ``{}`` with ``missing_ok``, else a RemoteError."""
        listed: dict[str, dict[str, dict[str, Any]]] = {}
        out = []
        for url in urls:
            entry = None
            if protocol_of(url) not in ("http", "https"):
                folder = parent(url)
                if folder not in listed:
                    listed[folder] = self._listing(folder)
                path = str(self.fs(url)._strip_protocol(url))  # s3://b/key -> b/key
                entry = listed[folder].get(path.rstrip("/"))
            if entry is None or entry.get("type") == "directory":
                entry = self.info(url, missing_ok)  # names a missing object in its error
            out.append(entry or {})
        return out

    def _listing(self, folder: str) -> dict[str, dict[str, Any]]:
        def ls(fs: Any, path: str) -> list[dict[str, Any]]:
            fs.invalidate_cache(path)
            return list(fs.ls(path, detail=True))

        try:
            entries = self.call(folder, ls)
        except RemoteError:
            return {}  # unlistable (no such folder, or listing denied): asked one by one
        return {str(e["name"]).rstrip("/"): e for e in entries}

    def glob(self, pattern: str) -> list[str]:
        """The URLs of the objects matching the glob ``pattern``, sorted."""

        def glob(fs: Any, path: str) -> list[str]:
            fs.invalidate_cache()
            return list(fs.glob(path))

        return sorted(self.url(pattern, p) for p in self.call(pattern, glob))

    def find(self, url: str) -> list[tuple[str, dict[str, Any]]]:
        """Every object and folder under the folder ``url`` (one listing, recursive), as
        ``(url, info)``, sorted by URL."""

        def find(fs: Any, path: str) -> dict[str, Any]:
            fs.invalidate_cache(path)
            return dict(fs.find(path, withdirs=True, detail=True))

        found = self.call(url, find)
        return sorted((self.url(url, str(p)), dict(info)) for p, info in found.items())

    def open(self, url: str, size: int, buffer_size: int = BLOCK_SIZE) -> BinaryIO:
        """``url`` as a seekable binary file of ``size`` bytes, read by retried range
        requests of at least ``buffer_size`` bytes (0: each read one request)."""
        raw = _RangeFile(self, url, size)
        if not buffer_size:
            return cast(BinaryIO, raw)
        return cast(BinaryIO, io.BufferedReader(raw, buffer_size=buffer_size))

    def sha256(self, url: str, size: int) -> str:
        """Hex sha256 of the object's bytes, read start to end in range requests."""
        digest = hashlib.sha256()
        with self.open(url, size) as f:
            while chunk := f.read(BLOCK_SIZE):
                digest.update(chunk)
        return digest.hexdigest()

    def retries(self) -> dict[str, int]:
        """Retries so far, by kind (those that happened)."""
        return {k: int(n) for k, n in zip(RETRY_KINDS, self.retried.tolist(), strict=True) if n}

    def _check_option(self, protocol: str, exc: BaseException) -> None:
        """Raise ConfigError, naming the option and where it goes, when ``exc`` is the
        TypeError of a storage option the filesystem of ``protocol`` does not take."""
        match = _UNEXPECTED_OPTION.search(str(exc)) if isinstance(exc, TypeError) else None
        where = _option_path(match.group(1), self.storage_options) if match else None
        if match is None or where is None:
            return
        name = match.group(1)
        at = f"data.storage_options.{where}"
        within = where[: -len(name)]  # "s3." for options given per protocol
        s3 = protocol in ("s3", "s3a")
        if s3 and name in _S3_CLIENT_OPTIONS and not within.endswith("client_kwargs."):
            raise ConfigError(
                f"{at} is an option of the S3 client, which s3fs takes in client_kwargs: give "
                f"it as data.storage_options.{within}client_kwargs.{name} "
                f"(storage_options: {{client_kwargs: {{{name}: ...}}}})"
            ) from None
        if s3 and within.endswith("client_kwargs."):
            what, known = "the S3 client", [*_S3_CLIENT_OPTIONS, "use_ssl", "config"]
        else:
            what, known = f"{protocol}:// URLs' filesystem", _filesystem_options(protocol)
        raise ConfigError(
            f"{at} is not an option of {what}{did_you_mean(name, known, parenthesised=True)}; "
            "remove it, or see its documentation for the options it takes"
        ) from None

    def __repr__(self) -> str:  # the options may name a profile or endpoint: no more
        return f"Remote({sorted(self.storage_options)})"


class _RangeFile(io.RawIOBase):
    """A remote object as a raw seekable file: each read is one retried range request."""

    def __init__(self, remote: Remote, url: str, size: int) -> None:
        self.remote, self.url, self.size, self.at = remote, url, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.at, io.SEEK_END: self.size}[whence]
        self.at = max(0, base + offset)
        return self.at

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self.size - self.at)
        if n <= 0:
            return 0
        data = self.remote.read(self.url, self.at, self.at + n)
        view[: len(data)] = data
        self.at += len(data)
        return len(data)


def object_version(info: Mapping[str, Any]) -> str:
    """An object's size and ETag (or the store's own checksum field), tab-separated."""
    size = info.get("size")
    for field in ("ETag", "etag", "md5Hash", "crc32c", "blob_id", "Content-MD5", "Last-Modified"):
        value = info.get(field)
        if value:
            return f"{size}\t{str(value).strip(chr(34))}"
    lfs = info.get("lfs")
    if isinstance(lfs, Mapping) and lfs.get("sha256"):
        return f"{size}\t{lfs['sha256']}"
    return f"{size}"


def transient_kind(exc: BaseException) -> str | None:
    """The kind of a transient failure (a key of :data:`RETRY_KINDS`), or None for a
    permanent one (missing object, access denied, a bad request)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return None
    for chain in _chain(exc):
        status, code = _status(chain)
        if code in _THROTTLE_CODES or status == 429:
            return "throttled"
        if code in _SERVER_CODES or status in _TRANSIENT_STATUS:
            return "server error"
        if status is not None and 400 <= status < 500:
            return None
        number = chain.errno if isinstance(chain, OSError) else None
        if _class_names(chain) & _CONNECTION_ERRORS or number in _CONNECTION_ERRNOS:
            return "connection"
        if number in (errno.EBUSY, 121):  # s3fs: 503, 500
            return "server error"
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then each exception it was raised from or while handling, once each."""
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        yield chain
        chain = chain.__cause__ or chain.__context__


def _class_names(exc: BaseException) -> set[str]:
    """The names of ``exc``'s class and its bases."""
    return {c.__name__ for c in type(exc).__mro__}


def _status(exc: BaseException) -> tuple[int | None, str | None]:
    """An HTTP error's status and (S3-style) error code, where the exception has them."""
    status = getattr(exc, "status", None) or getattr(exc, "status_code", None)
    code = None
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):  # botocore's ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", status)
        code = response.get("Error", {}).get("Code")
    return (status if isinstance(status, int) else None), code


def _failure(url: str, exc: BaseException, attempts: int, kind: str | None) -> str:
    """The one line for a read of ``url`` that failed for good."""
    reason = scrub(first_line(exc, with_type=not str(exc).strip()))
    if isinstance(exc, FileNotFoundError):
        return (
            f"{url} does not exist; check the URL (data.root and data.splits) and that the "
            "object was uploaded"
        )
    if any(_class_names(chain) & _NO_CREDENTIALS for chain in _chain(exc)):
        return (
            f"no credentials were found to read {url} ({reason}); give credentials "
            f"{WHERE_CREDENTIALS_GO}"
        )
    if type(exc).__name__ == "ProfileNotFound":  # botocore: no such profile
        return (
            f"cannot read {url}: {reason}; set data.storage_options.profile to a profile of "
            "the AWS credentials or config file (~/.aws/credentials, ~/.aws/config), or leave "
            "it out to read credentials from the environment (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY) or the machine's role"
        )
    if isinstance(exc, PermissionError) or _status(exc)[0] in (401, 403):
        return (
            f"access to {url} was denied ({reason}); give credentials that may read it "
            f"{WHERE_CREDENTIALS_GO}"
        )
    if kind is not None:
        return (
            f"reading {url} failed {attempts} times ({kind}: {reason}); the storage keeps "
            "failing: check the endpoint and the network, then run again, which resumes "
            "where this run stopped"
        )
    return f"cannot read {url}: {reason}"


def _option_path(name: str, options: Mapping[str, Any], at: str = "") -> str | None:
    """Where the key ``name`` lies in ``options`` (``client_kwargs.region_name``), or None."""
    for key, value in options.items():
        where = f"{at}{key}"
        if key == name:
            return where
        if isinstance(value, Mapping):
            found = _option_path(name, value, f"{where}.")
            if found is not None:
                return found
    return None


def _filesystem_options(protocol: str) -> list[str]:
    """The keyword options of the filesystem class of ``protocol`` ([] when not found)."""
    try:
        from fsspec import get_filesystem_class

        parameters = inspect.signature(get_filesystem_class(protocol).__init__).parameters
    except Exception:
        return []
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    secret = {"self", "key", "secret", "token", "username", "password", "session"}  # refused
    named = [n for n, p in parameters.items() if n not in secret and p.kind in keyword]
    return [*named, "profile"] if protocol in ("s3", "s3a") else named


def _missing(protocol: str, reason: str) -> str:
    extra = PROTOCOL_EXTRAS.get(protocol)
    if extra is None:
        return f"{protocol}:// URLs need a package fsspec names: {reason}"
    return f"{protocol}:// URLs need featcache[{extra}]; install it with: {install_command(extra)}"


def _known_protocol(name: str) -> bool:
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return False
    return name in known_implementations or name in registry


def retries_of(source: Any) -> dict[str, int]:
    """The retries of ``source``'s remote reads so far, by kind ({} when none)."""
    remote = getattr(source, "remote", None)
    return remote.retries() if isinstance(remote, Remote) else {}

"""URLs in configs and the rules of remote reads: which failures are retried, what a
credential looks like, and that local data keeps its fingerprints."""

from __future__ import annotations

import errno
import io
import tarfile
from pathlib import Path

import pytest

from featcache.config.spec import DataSpec, load_config
from featcache.errors import ConfigError
from featcache.sources import build_source
from featcache.sources.remote import Remote, RemoteError, ShortRead, transient_kind
from featcache.store.provenance import config_fingerprint
from featcache.util.urls import check_storage_options, check_url, is_url, join, relative


def test_urls_are_told_from_paths_and_joined():
    assert is_url("s3://b/k") and is_url("https://h/x") and is_url("hf://datasets/a/b")
    assert not is_url("data/train") and not is_url("/abs/path") and not is_url(None)
    assert join("s3://b/root/", "shards/a.tar") == "s3://b/root/shards/a.tar"
    assert join("s3://b/root", "https://h/x.tar") == "https://h/x.tar"
    assert relative("s3://b/root/shards/a.tar", "s3://b/root") == "shards/a.tar"
    assert relative("s3://other/a.tar", "s3://b/root") == "s3://other/a.tar"


class _HTTPError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class _ClientError(Exception):  # botocore's shape: a response mapping
    def __init__(self, status: int, code: str) -> None:
        super().__init__(code)
        self.response = {"ResponseMetadata": {"HTTPStatusCode": status}, "Error": {"Code": code}}


def _wrapped(cause: BaseException) -> OSError:
    error = OSError(errno.EIO, "wrapped")
    error.__cause__ = cause
    return error


def test_transient_failures_are_told_from_permanent_ones():
    assert transient_kind(_HTTPError(503)) == "server error"
    assert transient_kind(_HTTPError(429)) == "throttled"
    assert transient_kind(_wrapped(_ClientError(503, "SlowDown"))) == "throttled"
    assert transient_kind(_wrapped(_ClientError(500, "InternalError"))) == "server error"
    assert transient_kind(ConnectionResetError()) == "connection"
    assert transient_kind(ShortRead("got 10 of 20 bytes")) == "connection"
    assert transient_kind(TimeoutError()) == "connection"
    assert transient_kind(FileNotFoundError("b/k")) is None
    assert transient_kind(PermissionError("denied")) is None
    assert transient_kind(_HTTPError(404)) is None and transient_kind(ValueError("x")) is None


def test_retries_are_bounded_counted_and_end_in_one_line(monkeypatch):
    import featcache.sources.remote as remote_module

    monkeypatch.setattr(remote_module, "BACKOFF", 0.0)
    remote = Remote()
    calls = []

    def flaky(fs, path):
        calls.append(path)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return b"ok"

    assert remote.call("memory://bucket/x", flaky) == b"ok"
    assert remote.retries() == {"connection": 2}
    calls.clear()

    def down(fs, path):
        calls.append(path)
        raise _HTTPError(503)

    with pytest.raises(RemoteError) as info:
        remote.call("memory://bucket/y", down)
    assert len(calls) == remote_module.RETRIES + 1
    assert str(info.value).startswith("reading memory://bucket/y failed 6 times (server error")
    with pytest.raises(RemoteError, match="memory://bucket/z does not exist; check the URL"):
        remote.read("memory://bucket/z")


def test_credentials_are_refused_without_echoing_them():
    for options in ({"key": "AKIA1234"}, {"client_kwargs": {"aws_secret_access_key": "s3cr3t"}},
                    {"token": "ghp_abcdef"}, {"account_key": "k"}):  # fmt: skip
        with pytest.raises(ConfigError, match="would put a credential") as info:
            check_storage_options(options, "data.storage_options")
        assert not any(v in str(info.value) for v in ("AKIA1234", "s3cr3t", "ghp_abcdef"))
    check_storage_options(
        {"anon": True, "profile": "x", "endpoint_url": "http://h", "token": "anon"}, "data"
    )
    for url in ("https://me:pw@h/x.tar", "https://h/x.tar?sig=abc", "s3://b/x?X-Amz-Credential=a"):
        with pytest.raises(ConfigError, match="carries") as info:
            check_url(url, "data.root")
        assert "pw" not in str(info.value) and "abc" not in str(info.value)
    check_url("https://h/x.tar?download=1", "data.root")


def _local_data(root: Path) -> None:
    """A tiny deterministic folder: an image folder, a manifest and a shard (bytes that
    are never decoded: fingerprints read names and sizes)."""
    for c, cls in enumerate(["ant", "bee"]):
        (root / "images" / cls).mkdir(parents=True, exist_ok=True)
        for i in range(3):
            (root / "images" / cls / f"{i}.jpg").write_bytes(bytes([65 + c]) * (100 + 10 * i + c))
    lines = ["path,label"] + [f"images/{c}/{i}.jpg,{c}" for c in ("ant", "bee") for i in range(3)]
    (root / "m.csv").write_text("\n".join(lines) + "\n")
    with tarfile.open(root / "s.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(4):
            for name, data in ((f"k{i}.jpg", b"j" * (50 + i)), (f"k{i}.cls", str(i % 2).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


# Fingerprints of _local_data as featcache computed them before sources read URLs: local
# data keeps them, so its stores still resume and verify.
LOCAL_FINGERPRINTS = {
    "imagefolder": "9918a217bfd7f961cf50cf95d0ba956ea00a6a3dd0c047e4aa37315449f4e215",
    "manifest": "fe844ab374b11d02f1e0e5a7a83b4422c02d1377d84f44be94b7de5f8b7bf930",
    "webdataset": "4e5715677ae3a801e86ef221c99fca454144194287f7efaf46791bef906f3532",
}


def test_local_data_keeps_its_fingerprints(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCACHE_CACHE_DIR", "")
    _local_data(tmp_path)
    splits = {"imagefolder": "images", "manifest": "m.csv", "webdataset": "s.tar"}
    for source, split in splits.items():
        data = DataSpec(source=source, root=str(tmp_path), splits={"t": split})
        assert build_source(data, "t", None).fingerprint() == LOCAL_FINGERPRINTS[source]
    config = {
        "model": {"name": "resnet18"},
        "layers": ["layer1"],
        "data": {"source": "webdataset", "root": "data", "splits": {"train": "s.tar"}},
    }
    before = "6341d4e8722c2fb7aaf4bc7b3e07e09e35dbdd969c8abb28046c560d3c2a955c"
    assert config_fingerprint(load_config(config)) == before
    # How to reach the data is not what the data is: the options change no fingerprint.
    config["data"]["storage_options"] = {"profile": "research", "anon": False}
    assert config_fingerprint(load_config(config)) == before


def test_a_url_with_credentials_is_shown_with_its_port_and_without_them():
    signed = "https://127.0.0.1:8443/photos/hym?sig=pw"
    for url in ("https://me:pw@127.0.0.1:8443/photos/hym", signed):
        with pytest.raises(ConfigError, match="carries") as info:
            check_url(url, "data.root")
        message = str(info.value)
        assert "the URL https://127.0.0.1:8443/photos/hym carries" in message
        assert "pw" not in message and "me" not in message.split("carries")[0]
    with pytest.raises(ConfigError, match=r"the URL s3://bucket/x carries"):
        check_url("s3://key:secret@bucket/x", "data.root")

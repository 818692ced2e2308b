"""The webdataset source: samples stored as consecutive members of uncompressed tar shards
(see docs/guides/sources.md).

One pass over the tar headers indexes each shard (kept in :func:`index_cache_dir`, keyed
by the shard's identity and the options); ``ds[i]`` is then one positioned read, so the
source is map-style and resumes by position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import posixpath
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image

from featcache.errors import ConfigError, FeatcacheError, first_line
from featcache.sources.base import IMAGE_EXTENSIONS, SourceDataset, SourceRequest, Transform
from featcache.sources.decode import decode_bytes
from featcache.sources.remote import Remote, object_version
from featcache.sources.stamps import file_stamp, object_stamp
from featcache.sources.tabular import (
    EncodedImageSource,
    SplitFiles,
    check_columns,
    class_indices,
    split_paths,
    text_rows,
)
from featcache.util.fingerprints import file_line, lines_sha256

IMAGE_EXTS = tuple(ext[1:] for ext in IMAGE_EXTENSIONS)


class WebDatasetSource(EncodedImageSource):
    """Images (and labels) of the samples of tar shards; ids are the samples' keys.

    Holds the shards and per-sample int arrays (shard, offset, size); file handles, and
    the bytes of the batch fetched from a remote shard, are per process, never pickled.
    """

    def __init__(
        self,
        files: SplitFiles,
        ids: list[str],
        shard: np.ndarray,
        offset: np.ndarray,
        size: np.ndarray,
        exts: list[str],
        labels: np.ndarray | None,
        class_names: list[str] | None,
        transform: Transform | None,
        decode_size: int | None,
    ) -> None:
        super().__init__(ids, labels, class_names, transform, decode_size, files.remote)
        self.shards, self.names = files.paths, files.names
        self.shard, self.offset, self.size = shard, offset, size
        self.exts = exts
        self._fds: dict[int, int] = {}
        self._span: tuple[int, int, bytes | Exception] | None = None  # (shard, start, bytes)
        self._pid = os.getpid()

    @property
    def shard_starts(self) -> list[int]:
        """The first row of every shard after the first: extraction batches never cross
        them, and torchrun ranks take whole shards."""
        return (np.flatnonzero(np.diff(self.shard)) + 1).tolist()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}, "_span": None}

    def __del__(self) -> None:
        # this process's own descriptors only; at interpreter exit, nothing to do
        with contextlib.suppress(Exception):
            if self._pid == os.getpid():
                for fd in self._fds.values():
                    os.close(fd)

    def _fd(self, shard: int) -> int:
        if self._pid != os.getpid():  # a forked worker: its own descriptors
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(self.shards[shard], os.O_RDONLY)
        return fd

    def prefetch(self, rows: list[int]) -> None:
        """Fetch the bytes of ``rows`` (a batch: rows of one shard) from a remote shard in
        one range request; a failure is kept and raised by the rows it covers."""
        if self.remote is None or not rows:
            return
        shard = int(self.shard[rows[0]])
        rows = [r for r in rows if int(self.shard[r]) == shard]
        start = int(min(self.offset[r] for r in rows))
        end = int(max(self.offset[r] + self.size[r] for r in rows))
        try:
            data: bytes | Exception = self.remote.read(self.shards[shard], start, end)
        except FeatcacheError as exc:
            data = exc
        self._span = (shard, start, data)

    def read_bytes(self, i: int) -> bytes:
        """The encoded image of row ``i``."""
        shard, size, where = int(self.shard[i]), int(self.size[i]), self._where(i)
        if self.remote is not None:
            return self._read_remote(i, shard, size, where)
        try:
            data = os.pread(self._fd(shard), size, int(self.offset[i]))
        except OSError as exc:
            raise FeatcacheError(f"cannot read image {where}: {first_line(exc)}") from exc
        if len(data) != size:
            raise FeatcacheError(
                f"cannot read image {where}: the shard ends {size - len(data)} bytes early "
                "(it changed since it was indexed)"
            )
        return data

    def _read_remote(self, i: int, shard: int, size: int, where: str) -> bytes:
        offset = int(self.offset[i])
        if self._pid != os.getpid():
            self._span, self._pid = None, os.getpid()
        span = self._span
        if span is not None and span[0] == shard:
            start, data = span[1], span[2]
            if isinstance(data, Exception) and start <= offset:
                raise FeatcacheError(f"cannot read image {where}: {data}")
            if isinstance(data, bytes) and start <= offset and offset + size <= start + len(data):
                return data[offset - start : offset - start + size]
        assert self.remote is not None
        try:
            return self.remote.read(self.shards[shard], offset, offset + size)
        except FeatcacheError as exc:
            raise FeatcacheError(f"cannot read image {where}: {exc}") from None

    def _where(self, i: int) -> str:
        return f"{self.ids[i]}.{self.exts[i]} in shard {self.names[int(self.shard[i])]}"

    def _load(self, i: int) -> tuple[Image.Image, int]:
        return decode_bytes(self.read_bytes(i), self._where(i), self.decode_size), self.label(i)

    def change_stamps(self) -> list[str]:
        """Each sample's stamp: its image member's size and its shard's stamp, taken now."""
        if self.remote is not None:
            infos = self.remote.stat(self.shards)
            shard_stamps = [object_stamp(object_version(info)) for info in infos]
        else:
            shard_stamps = [file_stamp(path) for path in self.shards]
        shard_fields = ["\t".join(f"shard_{f}" for f in s.split("\t") if f) for s in shard_stamps]
        return [
            f"size={size}\t{shard_fields[shard]}"
            for size, shard in zip(self.size.tolist(), self.shard.tolist(), strict=True)
        ]

    def fingerprint(self, content: bool = False) -> str:
        """sha256 over the sample count and each shard's name and size (and bytes with
        ``content``); for URLs, each shard's URL, size and ETag as listed now."""
        lines = [f"webdataset\t{len(self)} samples"]
        if self.remote is None:
            shards = zip(self.shards, self.names, strict=True)
            return lines_sha256(lines + [file_line(name, path, content) for path, name in shards])
        for url, info in zip(self.shards, self.remote.stat(self.shards), strict=True):
            line = f"{url}\t{object_version(info)}"
            if content:
                line += "\t" + self.remote.sha256(url, int(info["size"]))
            lines.append(line)
        return lines_sha256(lines)


@dataclass
class _Sample:
    key: str
    image: tuple[int, int, str] | None = None  # (offset, size, extension)
    label: Any = None  # an int, a class name, or None
    text: str | None = None
    members: list[str] = field(default_factory=list)  # extensions seen, for errors


@dataclass
class _Options:
    image_ext: str | None  # data.image_column, or None: the first image extension
    label_field: str  # json field holding the label
    label_field_set: bool  # data.label_column given explicitly
    text_ext: str | None  # data.text_column: the member holding the text


def webdataset_source(request: SourceRequest) -> SourceDataset:
    """The samples of the tar shards the split names.

    Raises:
        ConfigError: no shards, a shard that is not a readable uncompressed tar, a key in
            two shards (or twice in one), a sample without an image, a bad label.
    """
    data, split, value, transform = request.args
    check_columns(data)
    if data.id_column:
        raise ConfigError(
            "data.id_column does not apply to data.source=webdataset: ids are the sample "
            "keys; remove it"
        )
    options = _Options(
        image_ext=data.image_column.lower().lstrip(".") if data.image_column else None,
        label_field=data.label_column or "label",
        label_field_set=data.label_column is not None,
        text_ext=data.text_column.lower().lstrip(".") if data.text_column else None,
    )
    files = split_paths(data, split, value, "tar shards")
    names, remote = files.names, files.remote
    first_shard: dict[str, int] = {}
    samples: list[_Sample] = []
    shard_of: list[int] = []
    for s, (path, name) in enumerate(zip(files.paths, names, strict=True)):
        if remote is None:
            index = _cached_index(Path(path), name, options)
        else:
            index = _cached_remote_index(path, files.versions[s], name, options, remote)
        for sample in index:
            other = first_shard.setdefault(sample.key, s)
            if other != s:
                raise ConfigError(
                    f"sample key {sample.key!r} is in two shards, {names[other]} and {name}; "
                    "keys must be unique across the shards of a split"
                )
            samples.append(sample)
            shard_of.append(s)
    if not samples:
        raise ConfigError(
            f"no samples in the {len(names)} shard(s) of split {split!r}; samples are tar "
            "members named <key>.<extension>"
        )
    labels, class_names = _labels(samples, names, shard_of, options)
    ids = [sample.key for sample in samples]
    if options.text_ext is not None:
        where = f"webdataset split {split} ({len(names)} shards, {files.identity()[:16]})"
        texts = [sample.text or "" for sample in samples]
        return text_rows(texts, labels, ids, class_names, request.tokenizer, data.max_length, where)
    for sample, s in zip(samples, shard_of, strict=True):
        if sample.image is None:
            found = ", ".join(sample.members) or "none"
            fix = (
                f"none is {options.image_ext!r}: check data.image_column"
                if options.image_ext
                else "set data.image_column to the image's extension"
            )
            raise ConfigError(
                f"sample {sample.key!r} in shard {names[s]} has no image member (its "
                f"extensions: {found}); {fix}"
            )
    offsets, sizes, exts = zip(*(sample.image for sample in samples if sample.image), strict=True)
    return WebDatasetSource(
        files,
        ids,
        shard=np.asarray(shard_of, dtype=np.int32),
        offset=np.asarray(offsets, dtype=np.int64),
        size=np.asarray(sizes, dtype=np.int64),
        exts=list(exts),
        labels=labels,
        class_names=class_names,
        transform=transform,
        decode_size=request.decode_size,
    )


INDEX_VERSION = 1  # of the cached index's layout


def index_cache_dir() -> Path | None:
    """Where shard indexes are kept: ``$FEATCACHE_CACHE_DIR/wds-index`` (by default under
    ``$XDG_CACHE_HOME/featcache`` or ``~/.cache/featcache``); None when it is set empty."""
    base = os.environ.get("FEATCACHE_CACHE_DIR")
    if base is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "featcache")
    return Path(base).expanduser() / "wds-index" if base else None


def _cached_index(path: Path, name: str, options: _Options) -> list[_Sample]:
    """:func:`_index_shard`, from the index cache when the shard has not changed."""
    try:
        stat = path.stat()
    except OSError:
        return _index_shard(path, name, options)  # names the shard in its error
    identity = [
        INDEX_VERSION,
        str(path.resolve()),
        stat.st_size,
        stat.st_mtime_ns,
        dataclasses.astuple(options),
    ]
    return _through_cache(identity, lambda: _index_shard(path, name, options))


def _cached_remote_index(
    url: str, version: str, name: str, options: _Options, remote: Remote
) -> list[_Sample]:
    """The index of the remote shard ``url``, from the index cache while its ``version``
    is unchanged; else read once, start to end."""

    def index() -> list[_Sample]:
        size = int(version.split("\t")[0])
        with remote.open(url, size) as raw:
            return _index_tar(raw, size, name, options)

    return _through_cache([INDEX_VERSION, url, version, dataclasses.astuple(options)], index)


def _through_cache(identity: list[Any], make: Callable[[], list[_Sample]]) -> list[_Sample]:
    """The samples cached under ``identity``, else ``make()``'s, cached."""
    folder = index_cache_dir()
    if folder is None:
        return make()
    file = folder / (hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32] + ".json")
    # absent, unreadable or of another version: index again
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(file.read_text())
        if cached["identity"] == json.loads(json.dumps(identity)):
            return [_Sample(**sample) for sample in cached["samples"]]
    samples = make()
    with contextlib.suppress(OSError):  # a read-only cache: the index is made again next time
        folder.mkdir(parents=True, exist_ok=True)
        partial = file.with_suffix(f".{os.getpid()}.tmp")
        entries = [dataclasses.asdict(sample) for sample in samples]
        partial.write_text(json.dumps({"identity": identity, "samples": entries}))
        os.replace(partial, file)  # whole or not at all, whichever rank writes last
    return samples


def _index_shard(path: Path, name: str, options: _Options) -> list[_Sample]:
    """The samples of one local shard."""
    try:
        file_size = path.stat().st_size
        raw = open(path, "rb")  # noqa: SIM115  (closed below)
    except OSError as exc:
        raise _not_a_tar(name, exc) from None
    with raw:
        return _index_tar(raw, file_size, name, options)


def _not_a_tar(name: str, exc: Exception) -> ConfigError:
    return ConfigError(
        f"webdataset shard {name} cannot be read as a tar file ({first_line(exc)}); "
        "shards must be uncompressed .tar files"
    )


def _index_tar(raw: BinaryIO, file_size: int, name: str, options: _Options) -> list[_Sample]:
    """The samples of one shard (the seekable file ``raw`` of ``file_size`` bytes)."""
    try:
        tar = tarfile.open(fileobj=raw, mode="r:")  # noqa: SIM115  (closed below)
    except (tarfile.TarError, OSError) as exc:
        raise _not_a_tar(name, exc) from None
    samples: list[_Sample] = []
    seen: set[str] = set()
    current: _Sample | None = None
    with tar:

        def read(member: tarfile.TarInfo) -> bytes:
            raw.seek(member.offset_data)
            return raw.read(member.size)

        try:
            for member in tar:
                if not member.isfile():
                    continue
                directory, base = posixpath.split(member.name)
                dot = base.find(".")
                if dot <= 0:  # no extension, or a hidden file: not part of a sample
                    continue
                if member.offset_data + member.size > file_size:
                    raise ConfigError(
                        f"webdataset shard {name} is truncated: member {member.name} ends at "
                        f"byte {member.offset_data + member.size} but the file has "
                        f"{file_size} bytes; write the shard again"
                    )
                key = posixpath.join(directory, base[:dot])
                ext = base[dot + 1 :].lower()
                if current is None or key != current.key:
                    if key in seen:
                        raise ConfigError(
                            f"sample key {key!r} appears twice in shard {name}, not in "
                            "consecutive members; keys must be unique, each sample's members "
                            "together"
                        )
                    seen.add(key)
                    current = _Sample(key)
                    samples.append(current)
                _add_member(current, ext, member, read, name, options)
        except tarfile.TarError as exc:
            what = "is truncated" if "end of data" in str(exc) else "is not a readable tar file"
            raise ConfigError(
                f"webdataset shard {name} {what} ({first_line(exc)}); write the shard again"
            ) from None
        # tarfile stops quietly at a damaged header or at the file's end; a complete shard
        # ends with the zero blocks of the end-of-archive marker.
        raw.seek(tar.offset)
        tail = raw.read(tarfile.BLOCKSIZE)
        if not tail:
            raise ConfigError(
                f"webdataset shard {name} is truncated: it ends after {len(samples)} samples "
                "without the end-of-archive marker; write the shard again"
            )
        if tail.strip(b"\0"):
            raise ConfigError(
                f"webdataset shard {name} is corrupt: no valid tar header at byte "
                f"{tar.offset} (of {file_size}); write the shard again"
            )
    return samples


def _add_member(
    sample: _Sample, ext: str, member: tarfile.TarInfo, read: Any, name: str, options: _Options
) -> None:
    sample.members.append(ext)
    wanted = ext == options.image_ext if options.image_ext else ext in IMAGE_EXTS
    if sample.image is None and wanted:
        sample.image = (member.offset_data, member.size, ext)
    elif ext == "cls" and not options.label_field_set:
        text = read(member).decode("utf-8", "replace").strip()
        try:
            sample.label = int(text)
        except ValueError:
            raise ConfigError(
                f"sample {sample.key!r} in shard {name}: its cls member holds {text[:40]!r}, "
                "not an integer class index"
            ) from None
    elif ext == "json" and sample.label is None:
        try:
            obj = json.loads(read(member))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"sample {sample.key!r} in shard {name}: its json member is not valid JSON "
                f"({first_line(exc)})"
            ) from None
        if isinstance(obj, dict) and options.label_field in obj:
            sample.label = obj[options.label_field]
    elif options.text_ext and ext == options.text_ext:
        sample.text = read(member).decode("utf-8", "replace")


def _labels(
    samples: list[_Sample], names: list[str], shard_of: list[int], options: _Options
) -> tuple[np.ndarray | None, list[str] | None]:
    labelled = [s for s in samples if s.label is not None]
    if not labelled:
        if options.label_field_set:
            raise ConfigError(
                f"data.label_column {options.label_field!r}: no sample's json member has "
                "that field; name the field that holds the label"
            )
        return None, None
    if len(labelled) < len(samples):
        i = next(i for i, s in enumerate(samples) if s.label is None)
        raise ConfigError(
            f"sample {samples[i].key!r} in shard {names[shard_of[i]]} has no label (no cls "
            f"member, no json field {options.label_field!r}) but others have one; label "
            "every sample or none"
        )
    values = [s.label for s in samples]
    labels, class_names = class_indices(values, f"webdataset labels ({options.label_field})")
    if class_names is None and len(labels) and labels.min() < 0:
        i = int(np.argmin(labels))
        raise ConfigError(
            f"sample {samples[i].key!r} in shard {names[shard_of[i]]}: label {labels[i]} "
            "must be >= 0"
        )
    return labels, class_names

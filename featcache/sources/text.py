"""Text sources: one text per row, tokenised once when the source is built (see
docs/guides/text.md); the ids are kept as one flat array plus offsets, so the source
pickles cheaply into DataLoader workers."""

from __future__ import annotations

import csv
import hashlib
import itertools
import os
import posixpath
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch
from tqdm.auto import tqdm

from featcache.config.spec import DataSpec
from featcache.errors import ConfigError, FeatcacheError
from featcache.sources.base import SourceDataset, jsonl_objects, label_indices, open_text
from featcache.sources.remote import Remote, object_version
from featcache.sources.tokenizer import Tokenizer
from featcache.util.fingerprints import file_sha256
from featcache.util.urls import check_url, is_url, join

TOKENIZE_BLOCK = 1024  # texts per tokenizer call
PROGRESS_FROM = 10_000  # texts from which building shows a progress bar

TEXT_SUFFIXES = (".csv", ".jsonl", ".ndjson", ".txt")


class TextSource(SourceDataset):
    """Tokenised texts with optional labels: ``ds[i] -> (tokens, label)``.

    ``tokens`` is ``{"input_ids": int64 [T_i], "attention_mask": int64 [T_i] (all ones)}``
    and ``label`` an int class index (-1 when there is none). A row whose text is empty
    raises :class:`FeatcacheError` when read, so ``loader.on_error: skip`` can skip it.
    """

    def __init__(
        self,
        token_ids: np.ndarray,
        offsets: np.ndarray,
        labels: np.ndarray | None,
        ids: list[str],
        class_names: list[str] | None,
        *,
        truncated: np.ndarray,
        empty: np.ndarray,
        pad_id: int,
        tokenizer_name: str,
        max_length: int | None,
        identity: str,
    ) -> None:
        super().__init__(ids, class_names, labels is not None, None)
        self.token_ids = token_ids  # int64 [sum of T_i]
        self.offsets = offsets  # int64 [N + 1]; row i is token_ids[offsets[i]:offsets[i + 1]]
        self.labels = labels  # int64 [N], or None
        self.truncated = truncated  # bool [N]: the row's tokens were cut to max_length
        self.empty = empty  # bool [N]: the row's text is empty or blank
        self.pad_values = {"input_ids": int(pad_id), "attention_mask": 0}
        self.tokenizer_name, self.max_length = tokenizer_name, max_length
        self.identity = identity
        self.file: str | None = None  # the file the texts were read from, for the fingerprint
        self.remote: Remote | None = None  # reads ``file`` when it is a URL

    @property
    def token_lengths(self) -> np.ndarray:
        """int64 [N]: tokens per row after truncation (0 for an empty text)."""
        return np.diff(self.offsets)

    @property
    def row_columns(self) -> dict[str, np.ndarray]:
        """Per-row arrays to record beside the features: ``num_tokens`` int64 [N] and
        ``truncated`` bool [N]."""
        return {"num_tokens": self.token_lengths, "truncated": self.truncated}

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], int]:
        i = self.position(index)
        if self.empty[i]:
            raise FeatcacheError(f"empty text in row {self.ids[i]}")
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        if start == stop:
            raise FeatcacheError(
                f"the text of row {self.ids[i]} gives no tokens ({self.tokenizer_name} keeps "
                "none of it), so the model has nothing to read"
            )
        input_ids = torch.from_numpy(self.token_ids[start:stop].copy())
        mask = torch.ones_like(input_ids)
        return {"input_ids": input_ids, "attention_mask": mask}, self.label(i)

    def fingerprint(self, content: bool = False) -> str:
        """sha256 over the sorted ids, the source's identity (a file's name and size; with
        ``content=True`` its bytes, or the token ids held in memory), the tokenizer's name
        and ``max_length``."""
        digest = hashlib.sha256()
        for sample_id in sorted(self.ids):
            digest.update(sample_id.encode() + b"\n")
        digest.update(f"identity\t{self.identity}\n".encode())
        if self.file is not None and self.remote is not None:  # a URL: as listed now
            info = self.remote.info(self.file) or {}
            digest.update(f"object\t{self.file}\t{object_version(info)}\n".encode())
            if content:
                digest.update(f"sha256\t{self.remote.sha256(self.file, info['size'])}\n".encode())
        elif self.file is not None:
            size = os.path.getsize(self.file) if os.path.exists(self.file) else -1
            digest.update(f"size\t{size}\n".encode())
        if content and self.remote is None:
            if self.file is not None and os.path.exists(self.file):
                digest.update(f"sha256\t{file_sha256(self.file)}\n".encode())
            else:
                digest.update(self.offsets.tobytes())
                digest.update(self.token_ids.tobytes())
                if self.labels is not None:
                    digest.update(self.labels.tobytes())
        digest.update(f"tokenizer\t{self.tokenizer_name}\nmax_length\t{self.max_length}\n".encode())
        return digest.hexdigest()

    def __repr__(self) -> str:
        classes = "unlabeled" if not self.has_labels else f"classes={len(self.class_names or [])}"
        return (
            f"TextSource(rows={len(self)}, {classes}, tokenizer={self.tokenizer_name!r}, "
            f"max_length={self.max_length})"
        )


def texts_source(
    texts: Sequence[str],
    labels: Sequence[int] | np.ndarray | None,
    ids: Sequence[str],
    class_names: list[str] | None,
    tokenizer: Tokenizer,
    max_length: int | None,
    identity: str,
) -> TextSource:
    """A :class:`TextSource` over texts held in memory (one per row).

    ``labels`` are class indices (-1: the row has none) or None; ``max_length`` caps the
    tokens per text (None: the tokenizer's own limit); ``identity`` names where the texts
    came from, for the fingerprint. Empty or blank texts are not tokenised.
    """
    n = len(texts)
    if len(ids) != n or (labels is not None and len(labels) != n):
        raise ConfigError(
            f"{identity}: {n} texts but {len(ids)} ids"
            + ("" if labels is None else f" and {len(labels)} labels")
            + "; give one of each per row"
        )
    limit = max_length if max_length is not None else tokenizer.max_length
    empty = np.fromiter((not text.strip() for text in texts), dtype=bool, count=n)
    lengths = np.zeros(n, dtype=np.int64)
    truncated = np.zeros(n, dtype=bool)
    blocks: list[np.ndarray] = []
    filled = np.flatnonzero(~empty)
    with tqdm(
        total=len(filled),
        unit="text",
        desc=f"tokenising {identity}",
        disable=len(filled) <= PROGRESS_FROM,
        dynamic_ncols=True,
    ) as bar:
        for start in range(0, len(filled), TOKENIZE_BLOCK):
            rows = filled[start : start + TOKENIZE_BLOCK]
            out = tokenizer([texts[i] for i in rows], limit)
            if len(out.ids) != len(rows) or len(out.truncated) != len(rows):
                raise FeatcacheError(
                    f"tokenizer {tokenizer.name!r} returned {len(out.ids)} token lists for "
                    f"{len(rows)} texts; it must return one per text"
                )
            counts = np.fromiter(map(len, out.ids), dtype=np.int64, count=len(rows))
            lengths[rows] = counts
            truncated[rows] = out.truncated
            flat = itertools.chain.from_iterable(out.ids)
            blocks.append(np.fromiter(flat, dtype=np.int64, count=int(counts.sum())))
            bar.update(len(rows))
    token_ids = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    label_array = None if labels is None else np.asarray(labels, dtype=np.int64).reshape(n)
    return TextSource(
        token_ids,
        offsets,
        label_array,
        [str(i) for i in ids],
        class_names,
        truncated=truncated,
        empty=empty,
        pad_id=tokenizer.pad_id,
        tokenizer_name=tokenizer.name,
        max_length=limit,
        identity=identity,
    )


def text_source(
    data: DataSpec, split: str, value: Any, transform: Any, tokenizer: Tokenizer | None
) -> TextSource:
    """The text source of one split: ``value`` is a .csv, .jsonl/.ndjson or .txt file
    (columns: docs/guides/text.md); ids default to ``<file name>:<line>`` (the record
    number for CSV). ``transform`` is unused (images only)."""
    if tokenizer is None:
        raise ConfigError(
            f"data.source={data.source} needs a tokenizer, and the model has none; use a text "
            "model (an hf: text model or dual encoder, or open_clip:), or pass tokenised "
            "dicts of tensors through the Python API"
        )
    file = _text_file(data, split, value)
    remote = Remote(data.storage_options) if is_url(file) else None
    suffix = _suffix(file)
    if suffix == ".txt":
        for option in ("text_column", "label_column", "id_column"):
            if getattr(data, option) is not None:
                raise ConfigError(
                    f"data.{option} is set but {_name(file)} is a .txt file (one text per "
                    "line, no columns); remove it, or use a .csv or .jsonl file"
                )
        records = list(_txt_records(file, remote))
    elif suffix == ".csv":
        records = list(_csv_records(file, remote))
    else:
        example = '{"text": "...", "label": 1}'
        records = [
            (f"line {n}", n, obj) for n, obj in jsonl_objects(file, str(file), example, remote)
        ]
    if not records:
        raise ConfigError(f"text file {file} has no rows; write one text per row")
    columns = list(dict.fromkeys(name for _, _, row in records for name in row))  # in order
    text_col = _column(data.text_column, "text", "text_column", columns, file, required=True)
    label_col = _column(data.label_column, "label", "label_column", columns, file)
    id_col = _column(data.id_column, "id", "id_column", columns, file)

    texts = [_text(file, where, row, text_col) for where, _, row in records]
    ids = _ids(file, records, id_col)
    labels, class_names = _labels(file, records, label_col)
    source = texts_source(texts, labels, ids, class_names, tokenizer, data.max_length, _name(file))
    source.file = str(file)
    source.remote = remote
    return source


# (where: "line 3" for messages, number: line or record number for ids, the row's values)
_Record = tuple[str, int, dict[str, Any]]


def _name(file: Path | str) -> str:
    """The file name of a path or URL."""
    return posixpath.basename(urlsplit(file).path) if isinstance(file, str) else file.name


def _suffix(file: Path | str) -> str:
    return posixpath.splitext(_name(file))[1].lower()


def _text_file(data: DataSpec, split: str, value: Any) -> Path | str:
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"data.splits.{split} must be a text file ({', '.join(TEXT_SUFFIXES)}), got {value!r}"
        )
    file: Path | str
    if is_url(value) or is_url(data.root):
        file = join(str(data.root), value) if data.root else value
        check_url(file, f"data.splits.{split}")
        suffix = _suffix(file)
    else:
        file = Path(value).expanduser()
        if data.root and not file.is_absolute():
            file = Path(data.root).expanduser() / file
        suffix = file.suffix
    if suffix.lower() not in TEXT_SUFFIXES:
        raise ConfigError(
            f"text file {file} must end in one of {', '.join(TEXT_SUFFIXES)}, "
            f"not {suffix or '(no suffix)'}"
        )
    if isinstance(file, Path) and not file.is_file():  # a missing object is named when read
        where = " (relative to data.root)" if data.root else ""
        raise ConfigError(
            f"text file not found: {file}; set data.splits.{split} to an existing file{where}"
        )
    return file


def _csv_records(file: Path | str, remote: Remote | None) -> Iterator[_Record]:
    with open_text(file, remote, newline="") as f:  # -sig: Excel writes a BOM
        reader = csv.reader(f)
        header = [name.strip() for name in next(reader, [])]
        if not any(header):
            raise ConfigError(f"{file} line 1: no header; the first row must name the columns")
        number = 0
        for cells in reader:
            if not any(cell.strip() for cell in cells):
                continue
            number += 1
            where = f"line {reader.line_num}"
            if len(cells) != len(header):
                raise ConfigError(
                    f"{file} {where}: {len(cells)} cells but the header has {len(header)}; "
                    "quote values that contain commas"
                )
            yield where, number, dict(zip(header, cells, strict=True))


def _txt_records(file: Path | str, remote: Remote | None) -> Iterator[_Record]:
    with open_text(file, remote, newline="") as f:
        for line, text in enumerate(f, start=1):
            text = text.rstrip("\r\n")
            if text.strip():
                yield f"line {line}", line, {"text": text}


def _column(
    named: str | None,
    default: str,
    option: str,
    columns: list[str],
    file: Path | str,
    required: bool = False,
) -> str | None:
    """The column to read: ``named``, else ``default`` when the file has it."""
    have = ", ".join(columns) or "none"
    if named is None:
        if default in columns or not required:
            return default if default in columns else None
        raise ConfigError(
            f"{_name(file)} has no {default!r} column; its columns: {have}; set data.{option} "
            "to the column that holds the texts"
        )
    if named not in columns:
        raise ConfigError(
            f"data.{option} {named!r} is not a column of {_name(file)}; its columns: {have}"
        )
    return named


def _text(file: Path | str, where: str, row: dict[str, Any], column: str | None) -> str:
    value = row.get(column) if column is not None else None
    if value is None:
        return ""  # no text in this row: it fails when read, like an empty one
    if not isinstance(value, str):
        raise ConfigError(
            f"{file} {where}: {column} is {type(value).__name__} {value!r}, not a string"
        )
    return value


def _ids(file: Path | str, records: list[_Record], column: str | None) -> list[str]:
    if column is None:
        return [f"{_name(file)}:{number}" for _, number, _ in records]
    first_at: dict[str, str] = {}  # id -> where it is, in row order
    for where, _, row in records:
        value = row.get(column)
        if isinstance(value, str):
            value = value.strip()
        if value is None or value == "" or isinstance(value, (bool, float, list, dict)):
            raise ConfigError(
                f"{file} {where}: id {value!r} in column {column!r} must be a non-empty string "
                "or integer"
            )
        sample_id = str(value)
        if sample_id in first_at:
            raise ConfigError(
                f"{file}: id {sample_id!r} appears on {first_at[sample_id]} and {where}; "
                f"the {column} column must be unique"
            )
        first_at[sample_id] = where
    return list(first_at)


def _labels(
    file: Path | str, records: list[_Record], column: str | None
) -> tuple[list[int] | None, list[str] | None]:
    """Class indices (and class names when the labels are strings), or (None, None)."""
    if column is None:
        return None, None
    values: list[tuple[str, int | str]] = []
    unlabeled = ""  # where the first row without a label is
    for where, _, row in records:
        value = row.get(column)
        if isinstance(value, str):
            value = value.strip()
            value = int(value) if re.fullmatch(r"[+-]?\d+", value) else value
        if value is None or value == "":
            unlabeled = unlabeled or where
            continue
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{file} {where}: {column} {value!r} must be an integer or a string")
        if isinstance(value, int) and value < 0:
            raise ConfigError(f"{file} {where}: {column} {value} must be >= 0")
        values.append((where, value))
    if not values:
        return None, None  # an empty label column: an unlabeled source
    if unlabeled:
        raise ConfigError(
            f"{file} {unlabeled}: no {column}, but other rows have one; label every row or none"
        )
    return label_indices(values, str(file))

"""sha256 fingerprints: of files, of ordered lines of text, of sample ids, of module weights."""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterable, Sequence

import torch
from torch import nn


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of the file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def lines_sha256(lines: Iterable[str]) -> str:
    """Hex sha256 of the lines, each followed by a newline, in the order given."""
    digest = hashlib.sha256()
    lines = iter(lines)
    while block := list(itertools.islice(lines, 4096)):  # one update per block: far fewer calls
        digest.update("".join(f"{line}\n" for line in block).encode())
    return digest.hexdigest()


def file_line(name: str, path: str | os.PathLike, content: bool) -> str:
    """``name``, the file's size (-1 when it is gone) and, with ``content``, its sha256,
    tab-separated: one line of a fingerprint over files."""
    size = os.path.getsize(path) if os.path.exists(path) else -1
    line = f"{name}\t{size}"
    if content and size >= 0:
        line += "\t" + file_sha256(path)
    return line


def ids_fingerprint(ids: Sequence[str]) -> str:
    """sha256 over the sorted sample ids: the same samples give the same fingerprint."""
    return lines_sha256(sorted(str(i) for i in ids))


def module_fingerprint(model: nn.Module) -> str:
    """sha256 over the names, dtypes, shapes and values of a module's parameters and buffers."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{value.dtype}:{list(value.shape)}".encode())
        digest.update(memoryview(value.reshape(-1).view(torch.uint8).numpy()))  # no copy
    return digest.hexdigest()

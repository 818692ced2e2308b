"""The tokenizer a text model gives its text sources: texts in, unpadded token ids per
text out (the loader pads each batch with :attr:`Tokenizer.pad_id`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Tokenized:
    """Token ids of a list of texts: ``ids[i]`` is text ``i``'s ids (special tokens
    included, truncated), ``truncated[i]`` whether tokens were cut to fit."""

    ids: list[list[int]]
    truncated: list[bool]


class Tokenizer(Protocol):
    """What a text source needs from a model's tokenizer: ``name`` identifies it in a
    store's provenance, ``pad_id`` fills padded (masked) positions, ``max_length`` is the
    model's own limit (None: no limit)."""

    name: str
    pad_id: int
    max_length: int | None

    def __call__(self, texts: Sequence[str], max_length: int | None) -> Tokenized:
        """Token ids of ``texts``, each cut to ``max_length`` tokens (None: the model's
        own limit), special tokens included."""
        ...

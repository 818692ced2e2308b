"""The tokenizer a text model gives its text sources: texts in, token ids per text out.

A :class:`Tokenizer` turns texts into unpadded token-id lists, special tokens included,
truncated to a maximum length; padding to a batch happens later, per batch, in the
loader (dynamic padding), with :attr:`Tokenizer.pad_id` and an attention mask. Model
kinds that take text (``hf:`` text models and dual encoders on text data, ``open_clip:``
text towers) return one in :class:`~featcache.models.registry.BuiltModel`.
"""

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
    """What a text source needs from a model's tokenizer.

    ``name`` identifies the tokenizer in a store's provenance (e.g. ``"hf:bert-base"`` or
    the sha256 of its vocabulary files); ``pad_id`` fills padded positions (masked out, so
    its value never reaches a stored feature); ``max_length`` is the model's own limit
    (positions it has embeddings for; None: no limit).
    """

    name: str
    pad_id: int
    max_length: int | None

    def __call__(self, texts: Sequence[str], max_length: int | None) -> Tokenized:
        """Token ids of ``texts``, each cut to ``max_length`` tokens (None: the model's
        own limit), special tokens included."""
        ...

"""Text sides of models, called with int64 ``[B, T]`` right-padded ``input_ids`` and
``attention_mask``, and their tokenizers (:class:`~featcache.sources.tokenizer.Tokenizer`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from featcache.config.spec import ModelSpec
from featcache.errors import ConfigError, FeatcacheError, first_line
from featcache.models.hub import Source, not_cached, remote_kwargs, snapshot
from featcache.sources.tokenizer import Tokenized
from featcache.util.fingerprints import file_sha256

# Files a transformers tokenizer reads, whichever a repository or folder has.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)
# transformers' model_max_length when a tokenizer states none (int(1e30)).
_NO_LIMIT = 1_000_000


@dataclass(eq=False)
class HFTokenizer:
    """A transformers tokenizer as a featcache :class:`~featcache.sources.tokenizer.Tokenizer`;
    ``pad_id`` is its pad, else end-of-sequence (GPT-2), else 0 token (padding is masked)."""

    tokenizer: Any = field(repr=False)
    name: str
    max_length: int | None
    pad_id: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        pads = (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id)
        self.pad_id = int(next((pad for pad in pads if pad is not None), 0))

    def __call__(self, texts: Sequence[str], max_length: int | None) -> Tokenized:
        """Ids of ``texts`` with special tokens, cut the tokenizer's way to ``max_length``."""
        texts = list(texts)
        limit = _limit(max_length, self.max_length)
        ids = self.tokenizer(texts, truncation=False, verbose=False)["input_ids"]
        truncated = [limit is not None and len(row) > limit for row in ids]
        long = [i for i, cut in enumerate(truncated) if cut]
        if long:  # tokenised again, so that the tokenizer places its end tokens itself
            cut = self.tokenizer(
                [texts[i] for i in long], truncation=True, max_length=limit, verbose=False
            )["input_ids"]
            for i, row in zip(long, cut, strict=True):
                ids[i] = row
        return Tokenized([[int(t) for t in row] for row in ids], truncated)


def hf_text_model(
    transformers: Any, module: nn.Module, source: Source, model: ModelSpec
) -> tuple[nn.Module, HFTokenizer]:
    """The text side of a transformers model and its tokenizer, whose ``max_length`` is the
    least of its ``model_max_length`` and the ``max_position_embeddings`` stated, if any."""
    tower = text_tower(module, source)
    tokenizer = load_tokenizer(transformers, source, model)
    config = getattr(module.config, "text_config", None) or module.config
    limits = [int(tokenizer.model_max_length)] if tokenizer.model_max_length < _NO_LIMIT else []
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        limits.append(positions)
    name = f"hf:{source.repo} sha256:{tokenizer_sha256(snapshot(source))}"
    return tower, HFTokenizer(tokenizer, name, min(limits, default=None))


def text_tower(module: nn.Module, source: Source) -> nn.Module:
    """The part of ``module`` that reads token ids: a dual encoder's ``text_model``, an
    encoder-decoder's encoder, or the model itself."""
    config = module.config
    if getattr(config, "text_config", None) is not None:
        tower = getattr(module, "text_model", None)
        if not isinstance(tower, nn.Module):
            raise ConfigError(
                f"model.name 'hf:{source.ref}': {type(module).__name__} has a text_config but "
                "no text_model to take text; use featcache.extract with its text encoder"
            )
        return tower
    if getattr(config, "is_encoder_decoder", False):
        return cast(nn.Module, module.get_encoder())  # type: ignore[operator]
    if getattr(config, "vocab_size", None) is None:  # ViT, DINOv2...: no token embedding
        raise ConfigError(
            f"model.name 'hf:{source.ref}': {type(module).__name__} is an image model "
            "with no text tower; text data needs a text model or a dual encoder"
        )
    return module


def load_tokenizer(transformers: Any, source: Source, model: ModelSpec) -> Any:
    """``AutoTokenizer.from_pretrained`` from local files; one line when none of
    :data:`TOKENIZER_FILES` is there (transformers would make an empty vocabulary)."""
    folder = snapshot(source)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing = FileNotFoundError(f"none of {', '.join(TOKENIZER_FILES[:4])}...")
        if source.folder is None:
            raise not_cached(source, missing)
        raise ConfigError(
            f"hf:{source.ref} has no tokenizer files ({first_line(missing)}); save one into "
            f"the folder with tokenizer.save_pretrained('{source.folder}')"
        )
    try:
        return transformers.AutoTokenizer.from_pretrained(
            source.location, **remote_kwargs(source, model), local_files_only=True
        )
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        if source.folder is not None:
            raise ConfigError(
                f"hf:{source.ref} has no tokenizer that transformers can load "
                f"({first_line(exc)}); save one into the folder with "
                f"tokenizer.save_pretrained('{source.folder}')"
            ) from exc
        raise not_cached(source, exc) from exc


def tokenizer_sha256(folder: Path) -> str:
    """One sha256 over the :data:`TOKENIZER_FILES` in ``folder``: names and contents."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            digest.update(f"{name}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


@dataclass(eq=False)
class OpenClipTokenizer:
    """An open_clip tokenizer as a featcache :class:`~featcache.sources.tokenizer.Tokenizer`.

    Ids end at the first end-of-text token (a causal tower never lets later positions
    change earlier ones); with ``fixed_length`` (towers that attend both ways, or pool the
    last position) they keep open_clip's padding to the context length.
    """

    tokenize: Callable[..., torch.Tensor] = field(repr=False)
    name: str
    max_length: int | None  # the context length
    end_id: int | None = field(repr=False)
    pad_id: int = field(default=0, repr=False)
    fixed_length: bool = field(default=False, repr=False)

    def __call__(self, texts: Sequence[str], max_length: int | None) -> Tokenized:
        """Ids of ``texts`` cut open_clip's way (end token kept) to ``max_length``."""
        texts = list(texts)
        limit = _limit(max_length, self.max_length) or 1
        # one position more tells which texts needed cutting
        wide = self.tokenize(texts, context_length=limit + 1)
        truncated = [bool(row[limit] != self.pad_id) for row in wide]
        rows = self.tokenize(texts, context_length=limit).tolist()
        if not self.fixed_length:
            rows = [self._unpad(row) for row in rows]
        return Tokenized([[int(t) for t in row] for row in rows], truncated)

    def _unpad(self, row: list[int]) -> list[int]:
        if self.end_id is not None and self.end_id in row:
            return row[: row.index(self.end_id) + 1]
        while row and row[-1] == self.pad_id:  # no end token: trailing padding
            row = row[:-1]
        return row


def open_clip_tokenizer(
    open_clip: Any, architecture: str, context_length: int, fixed_length: bool
) -> OpenClipTokenizer:
    """``open_clip.get_tokenizer(architecture)`` as an :class:`OpenClipTokenizer`."""
    try:
        tokenize = open_clip.get_tokenizer(architecture, context_length=context_length)
    except (OSError, ValueError) as exc:  # an HF tokenizer that is not cached
        raise FeatcacheError(
            f"open_clip could not load the tokenizer of {architecture}: {first_line(exc)}"
        ) from exc
    inner = getattr(tokenize, "tokenizer", None)  # open_clip's HF and SigLIP tokenizers
    end_id = getattr(tokenize, "eot_token_id", None)
    if end_id is None:
        end_id = getattr(inner, "eos_token_id", None)
    pad_id = getattr(inner, "pad_token_id", None) or 0
    return OpenClipTokenizer(
        tokenize, f"open_clip:{architecture}", context_length, end_id, pad_id, fixed_length
    )


def _limit(asked: int | None, model_limit: int | None) -> int | None:
    """The length texts are cut to: the one asked for, never past the model's limit."""
    return min((n for n in (asked, model_limit) if n is not None), default=None)

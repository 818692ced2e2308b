"""Text helpers shared by the tests: tokenizers that need no download, tiny text models."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from featcache.models.tokenizer import Tokenized

BOS, EOS, PAD = 1, 2, 0


class ByteTokenizer:
    """UTF-8 bytes as ids (byte + 3), between BOS and EOS; cut texts keep their EOS."""

    pad_id = PAD

    def __init__(self, name: str = "bytes", max_length: int | None = None) -> None:
        self.name = name
        self.max_length = max_length
        self.calls: list[int] = []  # texts per call

    def __call__(self, texts: Sequence[str], max_length: int | None) -> Tokenized:
        self.calls.append(len(texts))
        ids, cut = [], []
        for text in texts:
            tokens = [BOS, *(b + 3 for b in text.encode())]
            limit = max_length if max_length is not None else self.max_length
            if limit is not None and len(tokens) + 1 > limit:
                tokens = tokens[: limit - 1]
                cut.append(True)
            else:
                cut.append(False)
            ids.append([*tokens, EOS])
        return Tokenized(ids, cut)


class ByT5Adapter:
    """transformers' ByT5Tokenizer (no download: its vocabulary is the bytes) as a
    featcache Tokenizer."""

    def __init__(self) -> None:
        from transformers import ByT5Tokenizer

        self.tokenizer = ByT5Tokenizer()
        self.name = "hf:byt5"
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.max_length = None

    def __call__(self, texts: Sequence[str], max_length: int | None) -> Tokenized:
        full = self.tokenizer(list(texts))["input_ids"]
        if max_length is None:
            return Tokenized(full, [False] * len(full))
        cut = self.tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
        return Tokenized(cut, [len(a) > len(b) for a, b in zip(full, cut, strict=True)])


def tiny_bert(seed: int = 0) -> torch.nn.Module:
    """A seeded 2-layer BERT (hidden size 32) over a byte-sized vocabulary, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=384,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
    )
    return transformers.BertModel(config).eval()


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    """A seeded 2-layer GPT-2 (width 32) over a byte-sized vocabulary, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=384,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return transformers.GPT2Model(config).eval()

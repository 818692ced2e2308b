"""Text helpers shared by the tests: tokenizers that need no download, tiny text models."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml

from featcache.sources.tokenizer import Tokenized

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


WORDS = {0: ["calm", "quiet", "soft", "still"], 1: ["loud", "noisy", "harsh", "shrill"]}


def write_text_config(folder: Path) -> Path:
    """A tiny random BERT saved with a byte-level tokenizer into ``folder``, JSONL splits
    of short labelled texts (60 train, 20 test), and a config over them capturing a
    mean-pooled layer and per-token rows; returns the config's path."""
    import transformers

    tiny_bert().save_pretrained(folder / "bert")
    transformers.ByT5Tokenizer().save_pretrained(folder / "bert")
    rng = random.Random(0)
    for split, count in (("train", 60), ("test", 20)):
        with open(folder / f"{split}.jsonl", "w") as f:
            for i in range(count):
                label = i % 2
                words = [rng.choice(WORDS[label]) for _ in range(rng.randrange(1, 8))]
                text = " ".join(words)
                f.write(json.dumps({"id": f"{split}-{i}", "text": text, "label": label}) + "\n")
    spec = {
        "model": {"name": f"hf:{folder / 'bert'}"},
        "layers": [
            {"name": "encoder.layer.1", "reduce": "mean", "key": "mean"},
            {"name": "encoder.layer.1", "key": "tokens"},
        ],
        "data": {
            "source": "text",
            "root": str(folder),
            "splits": {"train": "train.jsonl", "test": "test.jsonl"},
            "max_length": 24,
        },
        "loader": {"batch_size": 8, "num_workers": 0},
        "store": {"dtype": "float32"},
        "output": {"dir": str(folder / "out")},
        "runtime": {"progress": False},
    }
    path = folder / "text.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path

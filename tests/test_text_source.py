"""Text sources: CSV/JSONL/txt files tokenised once, ids, labels, errors, fingerprints."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from featcache.config.spec import DataSpec
from featcache.errors import ConfigError, FeatcacheError
from featcache.sources import build_source
from featcache.sources.text import TextSource, text_source, texts_source
from tests.texts import BOS, EOS, PAD, ByT5Adapter, ByteTokenizer


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def spec(root: Path, file: str, **fields) -> DataSpec:
    return DataSpec(source="text", root=str(root), splits={"train": file}, **fields)


def tokens_of(text: str) -> list[int]:
    return [BOS, *(b + 3 for b in text.encode()), EOS]


def test_csv_with_string_labels_and_default_columns(tmp_path):
    (tmp_path / "train.csv").write_text(
        'text,label\nhello,pos\n"a, b",neg\nzz,pos\n', encoding="utf-8"
    )
    source = text_source(spec(tmp_path, "train.csv"), "train", "train.csv", None, ByteTokenizer())
    assert isinstance(source, TextSource)
    assert len(source) == 3
    assert source.ids == ["train.csv:1", "train.csv:2", "train.csv:3"]
    assert source.class_names == ["neg", "pos"]
    assert source.has_labels
    tokens, label = source[1]
    assert tokens["input_ids"].tolist() == tokens_of("a, b")
    assert label == 0
    assert [source[i][1] for i in range(3)] == [1, 0, 1]


def test_item_dtypes_and_shapes(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [{"text": "abc"}, {"text": "héllo"}])
    source = text_source(spec(tmp_path, "t.jsonl"), "train", "t.jsonl", None, ByteTokenizer())
    tokens, label = source[1]
    assert set(tokens) == {"input_ids", "attention_mask"}
    for value in tokens.values():
        assert value.dtype == torch.int64
        assert value.shape == (len("héllo".encode()) + 2,)
    assert tokens["attention_mask"].tolist() == [1] * 8
    assert label == -1
    assert not source.has_labels and source.class_names is None
    assert source.token_lengths.dtype == np.int64
    assert source.token_lengths.tolist() == [5, 8]
    assert source.truncated.dtype == np.bool_
    assert source.pad_values == {"input_ids": PAD, "attention_mask": 0}
    assert source[-1][0]["input_ids"].tolist() == tokens["input_ids"].tolist()
    with pytest.raises(IndexError):
        source[2]


def test_jsonl_with_id_and_int_labels(tmp_path):
    rows = [
        {"id": "a", "text": "one", "label": 2},
        {"id": 7, "text": "two", "label": 0},
    ]
    write_jsonl(tmp_path / "t.jsonl", rows)
    source = text_source(spec(tmp_path, "t.jsonl"), "train", "t.jsonl", None, ByteTokenizer())
    assert source.ids == ["a", "7"]
    assert source.class_names is None
    assert [source[i][1] for i in range(2)] == [2, 0]


def test_jsonl_default_ids_are_line_numbers(tmp_path):
    (tmp_path / "t.ndjson").write_text('{"text": "x"}\n\n{"text": "y"}\n', encoding="utf-8")
    source = text_source(spec(tmp_path, "t.ndjson"), "train", "t.ndjson", None, ByteTokenizer())
    assert source.ids == ["t.ndjson:1", "t.ndjson:3"]


def test_explicit_columns(tmp_path):
    rows = [{"key": "k1", "body": "hi", "y": "cat"}, {"key": "k2", "body": "yo", "y": "dog"}]
    write_jsonl(tmp_path / "t.jsonl", rows)
    data = spec(tmp_path, "t.jsonl", text_column="body", label_column="y", id_column="key")
    source = build_source(data, "train", None, tokenizer=ByteTokenizer())
    assert source.ids == ["k1", "k2"]
    assert source.class_names == ["cat", "dog"]
    assert source[1][0]["input_ids"].tolist() == tokens_of("yo")


def test_txt_one_text_per_line(tmp_path):
    (tmp_path / "lines.txt").write_text("first line, with a comma\n\nthird\n", encoding="utf-8")
    source = text_source(spec(tmp_path, "lines.txt"), "train", "lines.txt", None, ByteTokenizer())
    assert source.ids == ["lines.txt:1", "lines.txt:3"]
    assert not source.has_labels
    assert source[0][0]["input_ids"].tolist() == tokens_of("first line, with a comma")


def test_missing_explicit_column_lists_the_columns(tmp_path):
    (tmp_path / "t.csv").write_text("id,body,label\n1,x,0\n", encoding="utf-8")
    with pytest.raises(
        ConfigError, match=r"^[^\n]*'txt' is not a column of t.csv; its columns: id, body, label$"
    ):
        text_source(
            spec(tmp_path, "t.csv", text_column="txt"), "train", "t.csv", None, ByteTokenizer()
        )
    with pytest.raises(ConfigError, match="data.label_column 'y' is not a column"):
        data = spec(tmp_path, "t.csv", text_column="body", label_column="y")
        text_source(data, "train", "t.csv", None, ByteTokenizer())
    # No 'text' column and none named: the error names the columns and the option.
    with pytest.raises(
        ConfigError, match="no 'text' column; its columns: id, body, label; set data.text_column"
    ):
        text_source(spec(tmp_path, "t.csv"), "train", "t.csv", None, ByteTokenizer())


def test_duplicate_ids_name_the_id_and_both_lines(tmp_path):
    write_jsonl(
        tmp_path / "t.jsonl",
        [{"id": "x", "text": "a"}, {"id": "y", "text": "b"}, {"id": "x", "text": "c"}],
    )
    with pytest.raises(ConfigError, match=r"id 'x' appears on line 1 and line 3"):
        text_source(spec(tmp_path, "t.jsonl"), "train", "t.jsonl", None, ByteTokenizer())


def test_empty_text_fails_only_when_read(tmp_path):
    (tmp_path / "t.csv").write_text("id,text\na,hello\nb,   \nc,bye\n", encoding="utf-8")
    source = text_source(spec(tmp_path, "t.csv"), "train", "t.csv", None, ByteTokenizer())
    assert len(source) == 3
    assert source[2][0]["input_ids"].tolist() == tokens_of("bye")
    with pytest.raises(FeatcacheError, match=r"^empty text in row b$"):
        source[1]
    assert source.token_lengths.tolist() == [7, 0, 5]


def test_truncation_flags_and_lengths(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [{"text": "ab"}, {"text": "abcdefgh"}, {"text": "abcd"}])
    data = spec(tmp_path, "t.jsonl", max_length=6)
    source = text_source(data, "train", "t.jsonl", None, ByteTokenizer(max_length=512))
    assert source.token_lengths.tolist() == [4, 6, 6]
    assert source.truncated.tolist() == [False, True, False]
    assert source.max_length == 6
    columns = source.row_columns
    assert columns["num_tokens"].tolist() == [4, 6, 6]
    assert columns["truncated"].tolist() == [False, True, False]
    assert source[1][0]["input_ids"].tolist()[-1] == EOS
    # No data.max_length: the tokenizer's own limit applies.
    source = text_source(
        spec(tmp_path, "t.jsonl"), "train", "t.jsonl", None, ByteTokenizer(max_length=5)
    )
    assert source.max_length == 5
    assert source.truncated.tolist() == [False, True, True]


def test_byt5_tokenizer_adapter(tmp_path):
    rows = [{"text": "héllo", "label": "a"}, {"text": "a longer text", "label": "b"}]
    write_jsonl(tmp_path / "t.jsonl", rows)
    tokenizer = ByT5Adapter()
    source = text_source(
        spec(tmp_path, "t.jsonl", max_length=8), "train", "t.jsonl", None, tokenizer
    )
    expected = tokenizer.tokenizer("héllo")["input_ids"]
    assert source[0][0]["input_ids"].tolist() == expected
    assert source.token_lengths.tolist() == [len(expected), 8]
    assert source.truncated.tolist() == [False, True]
    assert source.pad_values["input_ids"] == tokenizer.tokenizer.pad_token_id
    assert source.class_names == ["a", "b"]


def test_fingerprint_follows_tokenizer_max_length_and_file(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "ab"}, {"text": "cd"}])

    def fingerprint(tokenizer=None, content=False, **fields) -> str:
        data = spec(tmp_path, "t.jsonl", **fields)
        source = text_source(data, "train", "t.jsonl", None, tokenizer or ByteTokenizer())
        return source.fingerprint(content=content)

    base = fingerprint()
    assert fingerprint() == base
    assert fingerprint(ByteTokenizer(name="other")) != base
    assert fingerprint(max_length=3) != base
    assert fingerprint(content=True) != base
    content = fingerprint(content=True)
    path.write_text('{"text": "ab"}\n{"text": "cx"}\n', encoding="utf-8")  # same size
    assert fingerprint() == base
    assert fingerprint(content=True) != content
    path.write_text('{"text": "ab"}\n{"text": "cde"}\n', encoding="utf-8")
    assert fingerprint() != base


def test_texts_source_in_memory():
    tokenizer = ByteTokenizer()
    texts = [f"text {i}" for i in range(2500)]
    source = texts_source(
        texts, [i % 3 for i in range(2500)], [f"r{i}" for i in range(2500)], ["a", "b", "c"],
        tokenizer, None, "memory/train",
    )  # fmt: skip
    assert tokenizer.calls == [1024, 1024, 452]  # tokenised in blocks
    assert source.token_ids.dtype == np.int64 and source.token_ids.ndim == 1
    assert source.offsets.tolist()[-1] == source.token_ids.size
    assert source[2499][0]["input_ids"].tolist() == tokens_of("text 2499")
    assert source[4][1] == 1
    other = texts_source(texts, None, [f"r{i}" for i in range(2500)], None, tokenizer, None, "x")
    assert other.fingerprint() != source.fingerprint()
    assert source.fingerprint(content=True) != source.fingerprint()


def test_tokenizer_none_and_missing_file(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [{"text": "ab"}])
    with pytest.raises(ConfigError, match=r"needs a tokenizer.*hf: text model.*open_clip"):
        text_source(spec(tmp_path, "t.jsonl"), "train", "t.jsonl", None, None)
    with pytest.raises(
        ConfigError, match=r"^text file not found: .*nope.jsonl; set data.splits.train"
    ):
        text_source(spec(tmp_path, "nope.jsonl"), "train", "nope.jsonl", None, ByteTokenizer())


def test_build_source_dispatch_and_pickle(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [{"text": "ab", "label": 1}, {"text": "cdef", "label": 0}])
    data = DataSpec(source="text", root=str(tmp_path), splits={"val": "t.jsonl"})
    source = build_source(data, "val", None, tokenizer=ByteTokenizer())
    assert isinstance(source, TextSource)
    copy = pickle.loads(pickle.dumps(source))
    for i in range(len(source)):
        (a, la), (b, lb) = source[i], copy[i]
        assert la == lb
        assert all(torch.equal(a[key], b[key]) for key in a)
    assert copy.fingerprint() == source.fingerprint()


def test_bad_rows_are_config_errors(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"text": "a"}\n{"text": 3}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="line 2: text is int 3, not a string"):
        text_source(spec(tmp_path, "t.jsonl"), "train", "t.jsonl", None, ByteTokenizer())
    (tmp_path / "t.jsonl").write_text(
        '{"text": "a", "label": 1}\n{"text": "b"}\n', encoding="utf-8"
    )
    with pytest.raises(ConfigError, match="line 2: no label, but other rows have one"):
        text_source(spec(tmp_path, "t.jsonl"), "train", "t.jsonl", None, ByteTokenizer())
    (tmp_path / "t.csv").write_text("text,label\na,1\nb,x\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="use all integers or all strings"):
        text_source(spec(tmp_path, "t.csv"), "train", "t.csv", None, ByteTokenizer())

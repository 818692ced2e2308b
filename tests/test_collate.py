"""Collate: dynamic padding of mapping inputs, masks, workers, and tensors of any rank."""

from __future__ import annotations

import json
import pickle

import torch
from torch.utils.data import DataLoader

from featcache.config.spec import DataSpec
from featcache.extraction.batches import Batch, Collate, SourceRows, collate
from featcache.sources.text import text_source
from tests.test_text_source import ByteTokenizer


def rows_of(values: list, labels: list[int] | None = None) -> list[tuple]:
    labels = labels or [-1] * len(values)
    return [(v, label, i, "") for i, (v, label) in enumerate(zip(values, labels, strict=True))]


def test_variable_length_mappings_are_padded_with_pad_values():
    items = [
        {"input_ids": torch.tensor([5, 6, 7]), "attention_mask": torch.ones(3, dtype=torch.long)},
        {"input_ids": torch.tensor([8]), "attention_mask": torch.ones(1, dtype=torch.long)},
    ]
    batch = Collate({"input_ids": 99, "attention_mask": 0})(rows_of(items, [3, 1]))
    assert batch.inputs["input_ids"].tolist() == [[5, 6, 7], [8, 99, 99]]
    assert batch.inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.attention_mask is batch.inputs["attention_mask"]
    assert batch.labels.tolist() == [3, 1]
    assert batch.rows.tolist() == [0, 1]
    assert not batch.error


def test_attention_mask_added_when_absent():
    items = [{"input_ids": torch.tensor([1, 2])}, {"input_ids": torch.tensor([3, 4, 5, 6])}]
    batch = collate(rows_of(items))
    assert batch.inputs["input_ids"].tolist() == [[1, 2, 0, 0], [3, 4, 5, 6]]
    mask = batch.inputs["attention_mask"]
    assert mask.dtype == torch.int64
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch.attention_mask is mask


def test_equal_lengths_stack_without_a_new_mask():
    items = [{"input_ids": torch.tensor([1, 2])}, {"input_ids": torch.tensor([3, 4])}]
    batch = collate(rows_of(items))
    assert batch.inputs["input_ids"].tolist() == [[1, 2], [3, 4]]
    assert "attention_mask" not in batch.inputs
    assert batch.attention_mask is None
    given = [{"x": torch.ones(2), "attention_mask": torch.tensor([1, 0])}] * 2
    assert collate(rows_of(given)).attention_mask.tolist() == [[1, 0], [1, 0]]


def test_multi_dimensional_mapping_values_pad_the_first_axis():
    items = [{"frames": torch.ones(2, 3)}, {"frames": torch.ones(4, 3)}]
    batch = Collate({"frames": -1})(rows_of(items))
    assert batch.inputs["frames"].shape == (2, 4, 3)
    assert batch.inputs["frames"][0, 2:].eq(-1).all()
    assert batch.inputs["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    bad = [{"frames": torch.ones(2, 3)}, {"frames": torch.ones(2, 5)}]
    batch = collate(rows_of(bad))
    assert batch.inputs is None
    assert "input 'frames': items of shapes [2, 3] and [2, 5]" in batch.error


def test_failed_samples_and_non_tensor_keys():
    items = [({"input_ids": torch.tensor([1]), "n": 1}, 0, 4, ""), (None, -1, 5, "broken")]
    batch = collate(items)
    assert batch.failed == [(5, "broken")]
    assert batch.rows.tolist() == [4]
    assert batch.inputs["n"].tolist() == [1]


def test_video_and_audio_tensors_stack():
    video = collate(rows_of([torch.rand(3, 4, 16, 16) for _ in range(3)]))
    assert video.inputs.shape == (3, 3, 4, 16, 16)
    assert video.attention_mask is None
    audio = collate(rows_of([torch.rand(100), torch.rand(100)]))
    assert audio.inputs.shape == (2, 100)
    images = collate(rows_of([torch.rand(3, 8, 8), torch.rand(3, 8, 9)]))
    assert images.inputs is None and "images of different sizes in one batch" in images.error


def test_collate_pickles():
    copy = pickle.loads(pickle.dumps(Collate({"input_ids": 7})))
    assert copy.pad_values == {"input_ids": 7}


def test_workers_give_the_same_batches(tmp_path):
    texts = [{"text": "x" * (1 + (i * 7) % 13), "label": i % 2} for i in range(23)]
    texts[5]["text"] = " "  # fails when read
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in texts), encoding="utf-8")
    data = DataSpec(source="text", root=str(tmp_path), splits={"train": "t.jsonl"})
    source = text_source(data, "train", "t.jsonl", None, ByteTokenizer())
    rows = SourceRows(source, range(2, 23))
    assert rows.pad_values == {"input_ids": 0, "attention_mask": 0}
    assert SourceRows(torch.utils.data.TensorDataset(torch.zeros(2, 3)), range(2)).pad_values == {}

    def batches(workers: int) -> list[Batch]:
        loader = DataLoader(
            rows, batch_size=4, num_workers=workers, collate_fn=Collate(rows.pad_values)
        )
        return list(loader)

    serial, parallel = batches(0), batches(2)
    assert len(serial) == len(parallel) == 6
    for a, b in zip(serial, parallel, strict=True):
        assert a.failed == b.failed
        assert torch.equal(a.rows, b.rows) and torch.equal(a.labels, b.labels)
        assert a.inputs.keys() == b.inputs.keys() == {"input_ids", "attention_mask"}
        for key in a.inputs:
            assert torch.equal(a.inputs[key], b.inputs[key])
        assert torch.equal(a.attention_mask, b.attention_mask)
    assert serial[0].failed == [(5, "empty text in row t.jsonl:6")]
    first = serial[0].inputs
    lengths = source.token_lengths[2:5]
    assert first["attention_mask"].sum(1).tolist() == lengths.tolist()
    assert first["input_ids"].shape[1] == lengths.max()

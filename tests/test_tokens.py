"""Token batches: masked reductions, per-token (ragged) rows, the token view, resume, shards."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import featcache
from featcache import FeatureDataset, FeatureStore, TokenDataset
from featcache.commands.verify import verify_store
from featcache.errors import ConfigError, FeatcacheError
from featcache.sources.text import texts_source
from featcache.store import StorePlan, StoreWriter, partial_path
from featcache.store.merge import combine_shards, merge_store
from tests.stores import durable_rows, overwrite_chunk
from tests.test_resume import assert_same_store
from tests.texts import ByteTokenizer, tiny_bert, tiny_gpt2

TEXTS = [
    "a",
    "the cat sat on the mat",
    "feature caches",
    "a much longer sentence, to make the padding of its batch mates visible",
    "hi",
    "tokens per row differ",
    "x y z",
    "one more text for the last batch",
    "padding never leaks",
    "ok",
]


def text_rows(texts=TEXTS, labels=None, max_length=None):
    labels = labels if labels is not None else [i % 2 for i in range(len(texts))]
    ids = [f"t{i}" for i in range(len(texts))]
    return texts_source(texts, labels, ids, None, ByteTokenizer(), max_length, "test")


def padded(source, rows):
    """The rows' inputs padded by hand: ``input_ids`` and ``attention_mask`` [B, T]."""
    items = [source[i][0] for i in rows]
    length = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), length, dtype=torch.long)
    mask = torch.zeros(len(items), length, dtype=torch.long)
    for j, item in enumerate(items):
        ids[j, : len(item["input_ids"])] = item["input_ids"]
        mask[j, : len(item["input_ids"])] = 1
    return ids, mask


def run(model, source, layers, path, **options):
    options = {"batch_size": 4, "num_workers": 0, "dtype": "float32", "progress": False} | options
    return featcache.extract(model, source, layers, path, **options)


@pytest.mark.parametrize(("build", "layer"), [(tiny_bert, "encoder.layer.0"), (tiny_gpt2, "h.0")])
def test_masked_reductions_equal_hidden_states_with_the_mask_applied_by_hand(
    build, layer, tmp_path
):
    model = build()
    source = text_rows()
    layers = [{"name": layer, "reduce": r, "key": r} for r in ("mean", "cls", "last", "max")]
    store = run(model, source, layers, tmp_path / "s.h5")
    ids, mask = padded(source, range(len(TEXTS)))
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    h = hidden.hidden_states[1]  # the output of block 0
    real = mask.bool().unsqueeze(-1)
    lengths = mask.sum(1)
    expected = {
        "mean": (h * real).sum(1) / lengths[:, None],
        "cls": h[:, 0],
        "last": h[torch.arange(len(h)), lengths - 1],
        "max": h.masked_fill(~real, float("-inf")).amax(1),
    }
    for key, value in expected.items():
        torch.testing.assert_close(store.read(key), value, atol=1e-5, rtol=1e-5, msg=key)


def test_padding_changes_nothing(tmp_path):
    """The same text in batches padded to different lengths gives the same values."""
    model = tiny_bert()
    layers = [
        {"name": "encoder.layer.1", "reduce": "mean", "key": "mean"},
        {"name": "encoder.layer.1", "reduce": "cls", "key": "cls"},
        {"name": "encoder.layer.1", "key": "tokens"},
    ]
    text = "feature caches"
    short = run(model, text_rows([text, "a"]), layers, tmp_path / "short.h5", batch_size=2)
    long = run(model, text_rows([text, TEXTS[3] * 3]), layers, tmp_path / "long.h5", batch_size=2)
    alone = run(model, text_rows([text]), layers, tmp_path / "alone.h5", batch_size=1)
    for key in ("mean", "cls"):
        reference = alone.read(key)[0]
        torch.testing.assert_close(short.read(key)[0], reference, atol=1e-6, rtol=0)
        torch.testing.assert_close(long.read(key)[0], reference, atol=1e-6, rtol=0)
    reference = alone.read_tokens("tokens", [0])[0]
    torch.testing.assert_close(long.read_tokens("tokens", [0])[0], reference, atol=1e-6, rtol=0)


def test_per_token_rows_hold_exactly_the_tokens_of_each_text(tmp_path):
    model = tiny_bert()
    source = text_rows()
    path = tmp_path / "tokens.h5"
    layers = [
        {"name": "encoder.layer.1"},
        {"name": "encoder.layer.1", "reduce": "mean", "key": "m"},
    ]
    store = run(model, source, layers, path, chunk_rows=16)
    offsets = store.offsets
    assert np.diff(offsets).tolist() == source.token_lengths.tolist()
    assert store.is_per_token("encoder.layer.1") and not store.is_per_token("m")
    assert store.file["features/encoder.layer.1"].shape == (offsets[-1], 32)
    for i in range(len(TEXTS)):
        item = source[i][0]
        with torch.no_grad():
            alone = model(**{k: v[None] for k, v in item.items()}).last_hidden_state[0]
        row = store.read_tokens("encoder.layer.1", [i])[0]
        torch.testing.assert_close(row, alone, atol=1e-5, rtol=1e-5)
        assert store.token_ids[offsets[i] : offsets[i + 1]].tolist() == item["input_ids"].tolist()
    # FeatureDataset serves each row as [T_i, D]; TokenDataset serves single tokens.
    rows = FeatureDataset(path, "encoder.layer.1")
    tokens = TokenDataset(path, "encoder.layer.1")
    assert len(tokens) == offsets[-1]
    for i in (0, 3, 9):
        features, label = rows[i]
        assert features.shape == (source.token_lengths[i], 32) and int(label) == i % 2
        for position in range(len(features)):
            token, row, at = tokens[int(offsets[i]) + position]
            assert (int(row), int(at)) == (i, position)
            assert torch.equal(token, features[position])
    seen = set()
    for batch, batch_rows, positions in tokens.batches(7, seed=3):
        for token, row, position in zip(batch, batch_rows, positions, strict=True):
            assert torch.equal(token, rows[int(row)][0][int(position)])
            seen.add((int(row), int(position)))
    assert len(seen) == offsets[-1]  # every token once
    with pytest.raises(ConfigError, match="per-token rows .*TokenDataset"):
        next(iter(rows.batches(4)))
    with pytest.raises(ConfigError, match="per-token rows .*read_tokens"):
        store.read("encoder.layer.1")


def test_skipped_rows_store_no_tokens(tmp_path):
    texts = ["first", "", "third text", "   ", "fifth"]
    source = text_rows(texts)
    with pytest.warns(UserWarning, match="2 of 5 samples skipped"):
        store = run(tiny_bert(), source, ["encoder.layer.0"], tmp_path / "s.h5", on_error="skip")
    assert store.ids == ["t0", "t2", "t4"]
    assert np.diff(store.offsets).tolist() == source.token_lengths[[0, 2, 4]].tolist()
    assert len(store.file["features/encoder.layer.0"]) == store.offsets[-1]
    assert [r["id"] for r in store.skipped] == ["t1", "t3"]


def test_torchrun_shards_combine_into_the_one_process_store(tmp_path):
    model, source = tiny_bert(), text_rows()
    layers = ["encoder.layer.1", {"name": "encoder.layer.1", "reduce": "last", "key": "last"}]
    whole = run(model, source, layers, tmp_path / "whole.h5")
    shards = [tmp_path / "s0.h5", tmp_path / "s1.h5"]
    run(model, source, layers, shards[0], rows=range(0, 4))
    run(model, source, layers, shards[1], rows=range(4, len(TEXTS)))
    # As torchrun's rank 0 does, with the key of the store over all rows.
    combined = combine_shards(
        tmp_path / "combined.h5", shards, {"resume_key": whole.attrs["resume_key"]}
    )
    np.testing.assert_array_equal(combined.offsets, whole.offsets)
    np.testing.assert_array_equal(combined.token_ids, whole.token_ids)
    for key in ("encoder.layer.1",):
        assert torch.equal(combined.read_tokens(key)[0], whole.read_tokens(key)[0])
    assert torch.equal(combined.read("last"), whole.read("last"))
    merged = merge_store(tmp_path / "combined.h5", tmp_path / "merged.h5", progress=False)
    np.testing.assert_array_equal(merged.offsets, whole.offsets)
    assert torch.equal(
        merged.read_tokens("encoder.layer.1")[0], whole.read_tokens("encoder.layer.1")[0]
    )
    assert verify_store(tmp_path / "merged.h5", quick=True).passed
    # The row edges are checksummed in every form of the store, as in the one-process one.
    for store in (whole, combined, merged):
        assert "checksums/offsets" in store.file, store.path


def test_info_and_quick_verify_describe_per_token_stores(tmp_path):
    store = run(tiny_bert(), text_rows(), ["encoder.layer.1"], tmp_path / "s.h5")
    text = store.describe().format()
    assert "[T, 32]" in text and f"tokens     {store.offsets[-1]}" in text
    result = verify_store(tmp_path / "s.h5", quick=True)
    assert result.passed, [(c.name, c.detail) for c in result.checks]


def test_token_batch_errors_are_one_clear_line(tmp_path):
    model = tiny_bert()

    class Extra(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return {"input_ids": torch.tensor([5, 6]), "pixel_mask": torch.ones(2)}, 0

    with pytest.raises(
        ConfigError,
        match="input 'pixel_mask' .*BertModel.forward, which takes: input_ids, attention_mask",
    ):
        run(model, Extra(), ["encoder.layer.0"], tmp_path / "a.h5")
    with pytest.raises(ConfigError, match="layer 'pooler': reduce=mean .*no token axis"):
        run(model, text_rows(), [{"name": "pooler", "reduce": "mean"}], tmp_path / "b.h5")
    assert not (tmp_path / "b.h5").exists()


RESUME_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    import featcache
    from tests.test_tokens import text_rows
    from tests.texts import tiny_bert

    model = tiny_bert()
    model.encoder.layer[0].register_forward_pre_hook(lambda m, a: time.sleep(0.03))
    rng = __import__("random").Random(5)
    texts = [" ".join("w%d" % rng.randrange(99) for _ in range(rng.randrange(1, 30)))
             for _ in range(1500)]
    featcache.extract(
        model, text_rows(texts), ["encoder.layer.1", {"name": "encoder.layer.1",
        "reduce": "mean", "key": "mean"}], sys.argv[1], batch_size=8, num_workers=0,
        chunk_rows=50, progress=False,
    )
    """
)


@pytest.mark.slow
def test_sigkill_mid_run_and_resume_gives_the_same_bytes(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RESUME_SCRIPT)
    root = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}

    def command(out):
        return [sys.executable, str(script), str(out)]

    reference = tmp_path / "reference.h5"
    subprocess.run(command(reference), check=True, env=env, cwd=root, timeout=300)
    store = tmp_path / "killed.h5"
    process = subprocess.Popen(command(store), env=env, cwd=root)
    deadline = time.monotonic() + 120
    # Killed once rows are durable, however slowly a loaded machine gets there.
    while durable_rows(partial_path(store)) == 0 and process.poll() is None:
        assert time.monotonic() < deadline, "no rows became durable"
        time.sleep(0.01)
    process.kill()
    process.wait(timeout=60)
    assert not store.exists(), "the run finished before it was killed; the test proves nothing"
    with h5py.File(partial_path(store), "r") as f:
        assert 0 < int(f["progress"][0]) < 1500
    subprocess.run(command(store), check=True, env=env, cwd=root, timeout=300)
    assert_same_store(store, reference)


def test_a_video_model_takes_clips_through_the_python_api(tmp_path):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.video.r3d_18().eval()
    clips = torch.randn(6, 3, 4, 32, 32, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(clips, torch.arange(6) % 3)
    layers = [{"name": "layer1", "reduce": "avg"}, {"name": "avgpool", "reduce": "flatten"}]
    store = run(model, data, layers, tmp_path / "video.h5", batch_size=3)
    captured = {}
    hooks = [
        model.layer1.register_forward_hook(lambda m, i, o: captured.__setitem__("layer1", o)),
        model.avgpool.register_forward_hook(lambda m, i, o: captured.__setitem__("avgpool", o)),
    ]
    with torch.no_grad():
        model(clips)
    for hook in hooks:
        hook.remove()
    assert store.shape("layer1") == (64,)
    torch.testing.assert_close(
        store.read("layer1"), captured["layer1"].mean(dim=(2, 3, 4)), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        store.read("avgpool"), captured["avgpool"].flatten(1), atol=1e-5, rtol=1e-5
    )


class TinyAudioNet(torch.nn.Module):
    """Waveforms ``[B, L]`` -> a 1-d conv stack ``[B, 8, L']`` -> class scores."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 8, 9, stride=4)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, waveform):
        features = self.conv(waveform.unsqueeze(1))
        return self.head(features.mean(-1))


def test_an_audio_model_takes_1d_waveforms(tmp_path):
    torch.manual_seed(0)
    model = TinyAudioNet().eval()
    waves = torch.randn(5, 400, generator=torch.Generator().manual_seed(2))
    data = torch.utils.data.TensorDataset(waves)
    store = run(model, data, [{"name": "conv", "reduce": "max"}], tmp_path / "audio.h5")
    with torch.no_grad():
        expected = model.conv(waves.unsqueeze(1)).amax(-1)
    assert not store.has_labels
    torch.testing.assert_close(store.read("conv"), expected, atol=1e-5, rtol=1e-5)


def test_grid_batches_sort_each_window_and_restart_at_shard_boundaries():
    from featcache.extraction.grid import GridBatches

    lengths = np.array([3, 9, 1, 7, 7, 2, 8, 5, 4])
    bucketed = GridBatches(range(9), 2, lengths=lengths, window=4)
    assert list(bucketed) == [[1, 3], [0, 2], [6, 4], [7, 5], [8]]  # longest first, per window
    assert len(bucketed) == 5 and list(bucketed.window_sizes()) == [4, 4, 1]
    plain = GridBatches(range(10, 19), 4, boundaries=[13, 30])
    assert list(plain) == [[0, 1, 2], [3, 4, 5, 6], [7, 8]]  # rows 10-12 | 13-16, 17-18
    assert len(plain) == 3


def test_the_resume_grid_and_torchrun_blocks_follow_shard_boundaries():
    from featcache.extraction.distributed import block
    from featcache.store.resume import grid_start

    assert grid_start(23, 0, 8, [13]) == 21  # 13 + 8: the grid restarts at the shard
    assert grid_start(12, 0, 8, [13]) == 8
    shards = [100, 250, 300]  # shards of 100, 150, 50 and 100 rows
    blocks = [block(400, 16, r, 2, shards) for r in range(2)]
    assert blocks == [range(0, 250), range(250, 400)]  # whole shards, near half each
    assert [block(400, 16, r, 8, shards) for r in range(8)][0] == range(0, 0)


def test_bucketed_batches_store_the_same_rows_in_source_order(tmp_path):
    rng = np.random.default_rng(0)
    texts = [" ".join(["w"] * int(n)) for n in rng.integers(0, 30, size=70)]  # a few empty
    source = text_rows(texts)
    layers = ["encoder.layer.1", {"name": "encoder.layer.1", "reduce": "mean", "key": "m"}]
    options = {"on_error": "skip", "batch_size": 4}
    with pytest.warns(UserWarning, match="skipped"):
        plain = run(tiny_bert(), source, layers, tmp_path / "plain.h5", **options)
    with pytest.warns(UserWarning, match="skipped"):
        bucketed = run(
            tiny_bert(), source, layers, tmp_path / "b.h5", bucket_by_length=True, **options
        )
    assert bucketed.ids == plain.ids and bucketed.labels.tolist() == plain.labels.tolist()
    assert bucketed.skipped == plain.skipped
    np.testing.assert_array_equal(bucketed.offsets, plain.offsets)
    np.testing.assert_array_equal(bucketed.token_ids, plain.token_ids)
    torch.testing.assert_close(bucketed.read("m"), plain.read("m"), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        bucketed.read_tokens("encoder.layer.1")[0],
        plain.read_tokens("encoder.layer.1")[0],
        atol=1e-5,
        rtol=1e-5,
    )
    assert bucketed.attrs["resume_key"]["bucket_window"] == 4 * 16


def test_unreadable_first_rows_are_skipped_like_any_other(tmp_path):
    """The dataset's kind (token mappings) is read off its first readable row, not row 0."""
    texts = ["", " ", "a b c", "d e", "f"]  # empty or blank texts fail when read
    layers = ["encoder.layer.0", {"name": "encoder.layer.0", "reduce": "mean", "key": "m"}]
    for bucket in (False, True):
        with pytest.warns(UserWarning, match="2 of 5 samples skipped"):
            store = run(
                tiny_bert(), text_rows(texts), layers, tmp_path / f"{bucket}.h5",
                on_error="skip", bucket_by_length=bucket, batch_size=2,
            )  # fmt: skip
        assert store.ids == ["t2", "t3", "t4"] and [s["index"] for s in store.skipped] == [0, 1]


def stopped_run(source, layers, path, stop_at, **options):
    """Run a tiny BERT over ``source`` until the ``stop_at``-th batch through its first
    block raises, as a crash would; returns the model, no longer failing, to rerun with.
    (The call before the first batch runs the one row that sizes the store.)"""
    model = tiny_bert()
    calls = {"n": -1}

    def fail_late(module, args):
        calls["n"] += 1
        if calls["n"] == stop_at:
            raise RuntimeError("stopped on purpose")

    handle = model.encoder.layer[0].register_forward_pre_hook(fail_late)
    with pytest.raises(Exception, match="stopped on purpose"):
        run(model, source, layers, path, **options)
    handle.remove()
    return model


def test_a_bucketed_run_resumes_on_its_window_grid(tmp_path):
    texts = [" ".join(["w"] * (i % 23 + 1)) for i in range(300)]
    source = text_rows(texts)
    layers = ["encoder.layer.0"]
    options = {"batch_size": 2, "bucket_by_length": True, "chunk_rows": 10}
    reference = run(tiny_bert(), source, layers, tmp_path / "ref.h5", **options)
    path = tmp_path / "resumed.h5"
    model = stopped_run(source, layers, path, 100, **options)
    with h5py.File(partial_path(path), "r") as f:
        durable = int(f["progress"][0])
    assert 0 < durable < 300
    run(model, source, layers, path, **options)
    assert_same_store(path, reference.path)


def test_bucketing_needs_token_inputs(tmp_path, images, resnet18):
    with pytest.raises(ConfigError, match="bucket_by_length .*not mappings of token tensors"):
        run(resnet18, images, ["layer1"], tmp_path / "x.h5", bucket_by_length=True)


def test_a_corrupted_token_chunk_names_its_tokens_and_rows(tmp_path):
    from featcache.errors import CorruptStoreError
    from tests.stores import corrupt_row

    path = tmp_path / "s.h5"
    store = run(tiny_bert(), text_rows(), ["encoder.layer.1"], path, chunk_rows=16)
    offsets = store.offsets
    store.close()
    corrupt_row(path, "features/encoder.layer.1", 20)  # token 20: in the chunk of tokens 16-31
    first = int(np.searchsorted(offsets, 16, side="right")) - 1
    last = int(np.searchsorted(offsets, 31, side="right")) - 1
    expected = f"layer encoder.layer.1 tokens 16-31 (rows {first}-{last}) fail their checksum"
    with pytest.raises(CorruptStoreError, match=re.escape(expected)):
        FeatureStore(path).read_tokens("encoder.layer.1")
    with pytest.raises(CorruptStoreError, match="tokens 16-31"):
        list(TokenDataset(path, "encoder.layer.1").batches(8))
    result = verify_store(path, quick=True)
    assert not result.passed and any("tokens 16-31" in c.detail for c in result.checks)


class Embedder(torch.nn.Module):
    """Token ids -> embeddings -> a linear layer; the byte '!' embeds to infinity."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(384, 8)
        with torch.no_grad():
            self.embed.weight[ord("!") + 3] = float("inf")
        self.mix = torch.nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask=None):
        return self.mix(self.embed(input_ids))


def test_per_token_rows_skip_non_finite_rows_whole_and_compress(tmp_path):
    texts = ["fine", "bad!", "also fine", "ok"]
    source = text_rows(texts)
    with pytest.warns(UserWarning, match="1 of 4 samples skipped"):
        store = run(
            Embedder(), source, ["mix"], tmp_path / "s.h5",
            on_nonfinite="skip", dtype="bfloat16", compression="lzf",
        )  # fmt: skip
    assert store.ids == ["t0", "t2", "t3"]
    assert store.skipped[0]["id"] == "t1" and "non-finite" in store.skipped[0]["reason"]
    assert np.diff(store.offsets).tolist() == source.token_lengths[[0, 2, 3]].tolist()
    assert store.file["features/mix"].compression == "lzf"
    values, offsets = store.read_tokens("mix")
    assert values.dtype == torch.bfloat16 and len(values) == offsets[-1] == store.offsets[-1]
    with torch.no_grad():
        expected = Embedder()(source[2][0]["input_ids"])
    torch.testing.assert_close(values[offsets[1] : offsets[2]], expected.bfloat16())


def test_a_row_of_zero_tokens_reads_as_an_empty_row(tmp_path):
    path = tmp_path / "z.h5"
    lengths = np.array([3, 0, 3])  # the empty row starts inside a chunk of tokens
    values = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    writer = StoreWriter(
        StorePlan(path, 3, ids_width=2, dtype="float32", chunk_rows=2, token_capacity=6)
    )
    index = np.arange(3)
    writer.append(
        index, ["a", "b", "c"], index, {"t": values}, lengths=lengths, ragged=frozenset({"t"})
    )
    writer.close(complete=True)
    store = FeatureStore(path)
    empty, offsets = store.read_tokens("t", [1])
    assert empty.shape == (0, 4) and offsets.tolist() == [0, 0]
    both, offsets = store.read_tokens("t", [1, 2])
    assert torch.equal(both, torch.from_numpy(values[3:])) and offsets.tolist() == [0, 0, 3]
    features, _ = FeatureDataset(path, "t", dtype=None)[1]
    assert features.shape == (0, 4)


def test_per_token_chunks_torn_past_the_last_mark_read_and_resume(tmp_path):
    """The offsets, token ids and per-token rows of a run that died while writing the
    chunks past its last mark. Read as it is, the partial store gives the durable rows'
    tokens, token ids and offsets as an uninterrupted run wrote them, and verify --quick
    finds its durable rows sound (and the store incomplete); the rerun writes those
    chunks whole again."""
    texts = [" ".join(["w"] * (i % 7 + 1)) for i in range(40)]
    source = text_rows(texts)
    layers = ["encoder.layer.0"]
    options = {"batch_size": 3, "chunk_rows": 7}
    reference = run(tiny_bert(), source, layers, tmp_path / "ref.h5", **options)
    path = tmp_path / "resumed.h5"
    model = stopped_run(source, layers, path, 9, **options)  # 24 rows appended
    partial = partial_path(path)
    with h5py.File(partial, "r") as f:
        durable = int(f["progress"][0])
        tokens = int(f["offsets"][durable])
        names = json.loads(f["progress"].attrs["datasets"])
        entries = dict(zip(names, f["progress"][1:], strict=True))
    assert 0 < durable < 24 and entries["index"] == 21 and entries["offsets"] == 21
    for name, count in entries.items():  # every chunk past the mark, torn
        if count < len(h5py.File(partial, "r")[name]):
            overwrite_chunk(partial, name, int(count))
    rows = list(range(durable))
    with (
        FeatureStore(reference.path) as expected,
        FeatureStore(partial, allow_incomplete=True) as store,
    ):
        assert np.array_equal(store.offsets, expected.offsets[: durable + 1])
        assert np.array_equal(store.token_ids, expected.token_ids[:tokens])
        values, offsets = store.read_tokens("encoder.layer.0", rows)
        wanted, wanted_offsets = expected.read_tokens("encoder.layer.0", rows)
        assert torch.equal(values, wanted) and np.array_equal(offsets, wanted_offsets)
    checks = {check.name: check.ok for check in verify_store(partial, quick=True).checks}
    assert checks["checksums"] and not checks["complete"]
    run(model, source, layers, path, **options)
    assert_same_store(path, reference.path)


class TokenIds(torch.utils.data.Dataset):
    """Items ``{"input_ids": [T]}`` with no attention mask, of the given lengths."""

    def __init__(self, lengths, mask=False):
        self.lengths, self.mask = lengths, mask

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        item = {"input_ids": torch.randint(1, 100, (self.lengths[i],), generator=g)}
        if self.mask:
            item["attention_mask"] = torch.ones(self.lengths[i], dtype=torch.long)
        return item, i % 2


def test_token_batches_that_need_no_padding_are_pooled_over_their_tokens(tmp_path):
    """avg and max of a token output pool its tokens whether or not a batch was padded:
    a batch of equal lengths, with no mask, used to pool the feature axis."""
    model = tiny_bert()
    layers = [{"name": "encoder.layer.0", "reduce": r, "key": r} for r in ("avg", "max")]
    equal = run(model, TokenIds([8] * 8), layers, tmp_path / "equal.h5")
    ids = torch.stack([TokenIds([8] * 8)[i][0]["input_ids"] for i in range(8)])
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[1]
    assert equal.shape("avg") == (32,) and equal.shape("max") == (32,)
    torch.testing.assert_close(equal.read("avg"), hidden.mean(dim=1))
    torch.testing.assert_close(equal.read("max"), hidden.amax(dim=1))
    # Mixed lengths: the padded batch reads its real tokens, the other all of its tokens,
    # as with a mask given by the dataset.
    lengths = [8, 8, 8, 8, 5, 8, 3, 8]
    mixed = run(model, TokenIds(lengths), layers, tmp_path / "mixed.h5")
    masked = run(model, TokenIds(lengths, mask=True), layers, tmp_path / "masked.h5")
    for key in ("avg", "max"):
        torch.testing.assert_close(mixed.read(key), masked.read(key))


def test_a_conv_map_of_token_ids_is_pooled_over_its_length(tmp_path):
    """A [B, C, L] map of a model that takes token ids (C not the token count) keeps
    being pooled over L, as any conv map is."""

    class TextCNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(100, 12)
            self.conv = torch.nn.Conv1d(12, 16, 3, padding=1)

        def forward(self, input_ids):
            return self.conv(self.embed(input_ids).transpose(1, 2))

    torch.manual_seed(0)
    model = TextCNN().eval()
    store = run(model, TokenIds([8] * 4), [{"name": "conv", "reduce": "avg"}], tmp_path / "s.h5")
    ids = torch.stack([TokenIds([8] * 4)[i][0]["input_ids"] for i in range(4)])
    with torch.no_grad():
        expected = model(ids).mean(dim=2)
    torch.testing.assert_close(store.read("conv"), expected)


def test_per_token_rows_of_padded_and_unpadded_batches_name_the_fix(tmp_path):
    """reduce none stores per-token rows of padded batches only, unless the items carry
    their own mask: a dataset that mixes the two is refused with that fix."""
    lengths = [8, 8, 8, 8, 5, 8, 8, 8]
    with pytest.raises(FeatcacheError, match="give the dataset's items an attention_mask"):
        run(tiny_bert(), TokenIds(lengths), ["encoder.layer.0"], tmp_path / "s.h5")
    masked = TokenIds(lengths, mask=True)
    store = run(tiny_bert(), masked, ["encoder.layer.0"], tmp_path / "masked.h5")
    assert store.is_per_token("encoder.layer.0")
    assert np.diff(store.offsets).tolist() == lengths


def test_per_token_rows_go_through_a_dataloader_padded_with_a_mask(tmp_path):
    """FeatureDataset.pad_tokens pads the rows of a batch to its longest and masks them."""
    store = run(tiny_bert(), text_rows(), ["encoder.layer.0"], tmp_path / "t.h5")
    dataset = FeatureDataset(store.path, "encoder.layer.0")
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, collate_fn=dataset.pad_tokens)
    rows = [dataset[i][0] for i in range(len(dataset))]
    seen = 0
    for values, mask, labels in loader:
        lengths = [len(row) for row in rows[seen : seen + len(labels)]]
        assert values.shape == (len(labels), max(lengths), 32) and mask.dtype == torch.bool
        assert mask.sum(dim=1).tolist() == lengths
        assert torch.equal(values[mask], torch.cat(rows[seen : seen + len(labels)]))
        assert not values[~mask].any()
        seen += len(labels)
    assert seen == len(TEXTS)
    both = FeatureDataset(store.path, ["encoder.layer.0"])  # a dict, and featcache.pad_tokens
    features, mask, _ = featcache.pad_tokens([both[1], both[3]])
    assert features["encoder.layer.0"].shape[:2] == mask.shape == (2, len(rows[3]))


def test_a_text_without_tokens_is_refused_naming_its_id_or_skipped(tmp_path):
    class Tokens(torch.utils.data.Dataset):
        ids = ["t0", "t1", "empty", "t3"]

        def __len__(self):
            return 4

        def __getitem__(self, i):
            ids = torch.tensor([] if i == 2 else [5, 6, 7][: i + 1], dtype=torch.long)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, i % 2

    with pytest.raises(FeatcacheError) as caught:
        run(tiny_bert(), Tokens(), ["encoder.layer.0"], tmp_path / "a.h5")
    message = str(caught.value)
    assert "it has no tokens" in message and "(sample empty)" in message
    assert "on_error=skip" in message and "preprocess" not in message
    with pytest.warns(UserWarning, match="1 of 4 samples skipped"):
        store = run(tiny_bert(), Tokens(), ["encoder.layer.0"], tmp_path / "b.h5", on_error="skip")
    assert store.ids == ["t0", "t1", "t3"]
    texts = text_rows(["a", "b", "c"])
    texts.offsets[2:] -= 3  # as if the tokenizer had kept none of "b" (of its 3 tokens)
    with pytest.raises(FeatcacheError, match="the text of row t1 gives no tokens"):
        texts[1]


def test_errors_of_token_batches_give_no_image_advice(tmp_path):
    class Refusing(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            raise RuntimeError("no such embedding")

    with pytest.raises(FeatcacheError) as caught:
        run(Refusing(), text_rows(), ["."], tmp_path / "x.h5")
    message = str(caught.value)
    assert "tokenizer (data.max_length)" in message and "preprocess" not in message

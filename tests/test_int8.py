"""int8 stores: 8-bit codes with one float32 scale per row (per token), read back as
float32 within half a step of the float32 store, checked, resumed and verified."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
import yaml

import featcache
from featcache.commands.verify import verify_store
from featcache.errors import ConfigError, FeatcacheError
from featcache.extraction.compare import TOLERANCE
from featcache.store import FeatureStore, merge_store, partial_path
from featcache.store.codec import dequantize, quantize
from tests.test_resume import LAYERS, OPTIONS, Flaky, assert_same_store
from tests.texts import write_text_config


def half_step_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference of each row over its largest magnitude, over all rows, in
    units of an int8 step (the row's largest over 127)."""
    got, want = got.flatten(1), want.flatten(1)
    scale = want.abs().amax(dim=1).clamp(min=1e-30)
    return float(((got - want).abs().amax(dim=1) / scale * 127).max())


def test_quantize_keeps_every_value_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(64, 3, 5) * torch.logspace(-3, 3, 64)[:, None, None]
    x[5] = 0  # an all-zero row: scale 0, codes 0
    codes, scales = quantize(x)
    assert codes.dtype == torch.int8 and scales.shape == (64,) and codes.shape == x.shape
    assert int(codes.abs().max()) == 127 and float(scales[5]) == 0.0
    back = dequantize(codes, scales)
    assert torch.equal(back[5], torch.zeros(3, 5))
    assert half_step_error(back[:5], x[:5]) <= 0.5 + 1e-4


def test_an_int8_store_reads_as_float32_within_half_a_step(resnet18, tmp_path):
    float32 = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "f.h5", dtype="float32",
                                **OPTIONS)  # fmt: skip
    int8 = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "i.h5", dtype="int8", **OPTIONS)
    assert int8.ids == float32.ids and np.array_equal(int8.labels, float32.labels)
    for layer in ("layer2", "layer4"):
        got, want = int8.read(layer), float32.read(layer)
        assert got.dtype == torch.float32 and int8.dtype(layer) == torch.float32
        assert half_step_error(got, want) <= 0.5 + 1e-3
        rows = [7, 3, 3, 39]
        assert torch.equal(int8.read(layer, rows), got[rows])
    with h5py.File(tmp_path / "i.h5") as f:  # plain datasets any HDF5 tool reads
        codes, scales = f["features/layer4"][()], f["scales/layer4"][()]
        assert codes.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == (40,)
        assert f["features/layer4"].attrs["dtype"] == b"int8"
        by_hand = codes.astype(np.float32) * scales[:, None]
        assert np.array_equal(by_hand, int8.read("layer4").numpy())

    dataset = featcache.FeatureDataset(tmp_path / "i.h5", ["layer2", "layer4"])
    assert torch.equal(dataset[5][0]["layer4"], int8.read("layer4")[5])
    for read_ahead in (True, False):
        seen = {}
        for features, _, index in dataset.batches(8, seed=1, with_index=True,
                                                  read_ahead=read_ahead):  # fmt: skip
            for j, row in enumerate(index.tolist()):
                seen[row] = features["layer2"][j]
        assert sorted(seen) == list(range(40))
        assert torch.equal(torch.stack([seen[r] for r in range(40)]), int8.read("layer2"))
    in_memory = featcache.FeatureDataset(tmp_path / "i.h5", "layer4", in_memory=True)
    batch = next(iter(in_memory.batches(40, shuffle=False)))[0]
    assert torch.equal(batch, int8.read("layer4"))


def test_int8_rows_take_about_half_the_bytes_of_float16(resnet18, tmp_path):
    sizes = {}
    for dtype in ("float16", "int8"):
        path = tmp_path / f"{dtype}.h5"
        featcache.extract(resnet18, Flaky(), LAYERS, path, dtype=dtype, **OPTIONS)
        with h5py.File(path) as f:  # layer4: 512 values a row
            sizes[dtype] = f["features/layer4"].id.get_storage_size() + (
                f["scales/layer4"].id.get_storage_size() if dtype == "int8" else 0
            )
    assert sizes["int8"] <= 0.51 * sizes["float16"]


def test_an_interrupted_int8_run_resumes_to_the_uninterrupted_store(resnet18, tmp_path):
    options = dict(OPTIONS, dtype="int8")
    reference = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "ref.h5", **options)
    path = tmp_path / "s.h5"
    with pytest.raises(FeatcacheError, match="simulated crash"):
        featcache.extract(resnet18, Flaky(fail_at=27), LAYERS, path, **options)
    assert partial_path(path).exists()
    featcache.extract(resnet18, Flaky(), LAYERS, path, **options)
    assert_same_store(path, reference.path)
    with h5py.File(path) as a, h5py.File(reference.path) as b:
        assert np.array_equal(a["scales/layer2"][()], b["scales/layer2"][()])
    merged = merge_store(path, tmp_path / "merged.h5", progress=False)
    assert torch.equal(merged.read("layer2"), reference.read("layer2"))


def test_int8_refuses_to_keep_nonfinite_values_and_to_update(resnet18, tmp_path):
    with pytest.raises(ConfigError, match="int8 cannot hold NaN or Inf"):
        featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "k.h5", dtype="int8",
                          on_nonfinite="keep", **OPTIONS)  # fmt: skip
    path = tmp_path / "u.h5"
    featcache.extract(resnet18, Flaky(), LAYERS, path, dtype="int8", **OPTIONS)
    more = [{"name": "layer3", "reduce": "max"}, *LAYERS]
    with pytest.raises(ConfigError, match="int8 codes, which an update does not copy"):
        featcache.extract(resnet18, Flaky(), more, path, dtype="int8", update=True, **OPTIONS)


def test_int8_text_tokens_read_verify_and_resume_as_a_float_store(tmp_path):
    config = yaml.safe_load(write_text_config(tmp_path).read_text())
    config["data"]["splits"] = {"train": "train.jsonl"}
    stores = {}
    for dtype in ("float32", "int8"):
        one = dict(config, store={"dtype": dtype}, output={"dir": str(tmp_path / dtype)})
        (tmp_path / f"{dtype}.yaml").write_text(yaml.safe_dump(one))
        stores[dtype] = featcache.extract_from_config(tmp_path / f"{dtype}.yaml")["train"]
    int8, float32 = stores["int8"], stores["float32"]
    tokens, offsets = int8.read_tokens("tokens", [3, 0])
    want, want_offsets = float32.read_tokens("tokens", [3, 0])
    assert np.array_equal(offsets, want_offsets) and tokens.dtype == torch.float32
    assert half_step_error(tokens, want) <= 0.5 + 1e-3  # one scale per token
    view = featcache.TokenDataset(int8.path, "tokens")
    everything = torch.cat([b[0] for b in view.batches(64, shuffle=False)])
    assert torch.equal(everything, int8.read_tokens("tokens")[0])
    in_memory = featcache.TokenDataset(int8.path, "tokens", in_memory=True)
    assert torch.equal(in_memory[10][0], everything[10])
    result = verify_store(int8.path, samples=-1)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.ok]
    assert f"tolerance {TOLERANCE['int8']:g}" in result.checks[-1].detail
    again = featcache.extract_from_config(tmp_path / "int8.yaml")["train"]  # proven, kept
    assert again.path == int8.path
    bucketed = dict(config, store={"dtype": "int8"}, output={"dir": str(tmp_path / "bucketed")})
    bucketed["loader"] = dict(config["loader"], bucket_by_length=True)
    windows = featcache.extract_from_config(bucketed)["train"]  # rows merged back in order
    tokens, offsets = windows.read_tokens("tokens")
    assert np.array_equal(offsets, float32.read_tokens("tokens")[1])
    assert half_step_error(tokens, float32.read_tokens("tokens")[0]) <= 0.5 + 1e-2


def test_verify_finds_an_int8_row_whose_scale_changed(tmp_path):
    config = yaml.safe_load(write_text_config(tmp_path).read_text())
    config["data"]["splits"] = {"train": "train.jsonl"}
    config["store"] = {"dtype": "int8", "checksum": False}  # the damage is not a bad chunk
    store = featcache.extract_from_config(config)["train"]
    store.close()
    with h5py.File(store.path, "r+") as f:
        f["scales/mean"][4] *= 1.5
    result = verify_store(store.path, samples=-1)
    values = next(c for c in result.checks if c.name == "values")
    assert not values.ok and "mean: rows 4 differ" in values.detail
    assert FeatureStore(store.path).read("mean").shape[0] == 60


def test_a_recomputation_copies_codes_and_scales_out_of_reused_host_buffers():
    """On CUDA a batch arrives in pinned host buffers that the next batch reuses: what a
    recomputation keeps (a resume's continuity check, verify) must be its own copy."""
    from featcache.extraction.run import Collected
    from featcache.extraction.writer_thread import CapturedBatch

    codes, scales = torch.full((4, 3), 7, dtype=torch.int8), torch.full((4,), 0.5)
    released = []
    batch = CapturedBatch(
        index=np.arange(4),
        ids=["a", "b", "c", "d"],
        labels=np.zeros(4, dtype=np.int64),
        features={"layer": codes[:4]},
        ready=None,
        skipped=[],
        release=lambda: released.append(True),
        scales={"layer": scales[:4]},
    )
    collected = Collected()
    collected.put(batch, {})
    codes.zero_()  # the next batch fills the same buffers
    scales.zero_()
    assert released == [True]
    kept = collected.batches[0]
    assert torch.equal(kept.features["layer"], torch.full((4, 3), 7, dtype=torch.int8))
    assert torch.equal(kept.scales["layer"], torch.full((4,), 0.5))
    assert torch.equal(kept.values("layer", "int8"), torch.full((4, 3), 3.5))

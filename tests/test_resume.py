"""Crash safety: killed runs resume to exactly the store an uninterrupted run writes."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import yaml

import featcache
from featcache.errors import ConfigError, CorruptStoreError, FeatcacheError
from featcache.store import FeatureStore, partial_path
from featcache.store import writer as store_writer
from tests.stores import break_chunk_key, durable_rows, overwrite_chunk

KILL_CONFIG = {
    "model": {"name": "resnet18"},
    "preprocess": {"mean": [0.485, 0.456, 0.406]},  # 32px as it is
    "layers": [{"name": "layer1"}, {"name": "layer3", "reduce": "avg"}],
    "data": {
        "source": "synthetic",
        "kwargs": {"image_size": 32, "num_classes": 7},
        "splits": {"train": {"size": 6000}},
    },
    "loader": {"batch_size": 16, "num_workers": 0},
    "store": {"chunk_rows": 24},  # not a multiple of the batch: resumes split chunks
    "runtime": {"progress": False},
}


def _config_file(folder: Path) -> Path:
    config = dict(KILL_CONFIG, output={"dir": str(folder / "out")})
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _extract_command(config: Path) -> list[str]:
    return [sys.executable, "-m", "featcache", "extract", str(config)]


def assert_same_store(a: Path, b: Path) -> None:
    """Every dataset equal, byte for byte, and the same fingerprints."""
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        names: list[str] = []
        fa.visit(lambda name: names.append(name) if isinstance(fa[name], h5py.Dataset) else None)
        other: list[str] = []
        fb.visit(lambda name: other.append(name) if isinstance(fb[name], h5py.Dataset) else None)
        assert sorted(names) == sorted(other)
        for name in names:
            if name == "progress":
                continue
            assert fa[name].dtype == fb[name].dtype, name
            np.testing.assert_array_equal(fa[name][()], fb[name][()], err_msg=name)
        for key in ("config_fingerprint", "dataset_fingerprint", "num_rows", "complete"):
            assert fa.attrs.get(key) == fb.attrs.get(key), key


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_equals_uninterrupted(tmp_path):
    reference = _config_file(tmp_path / "reference")
    subprocess.run(_extract_command(reference), check=True, capture_output=True, timeout=300)
    config = _config_file(tmp_path / "killed")
    store = tmp_path / "killed" / "out" / "train.h5"
    partial = partial_path(store)
    rng = random.Random(20261121)
    kills, progress_seen = 0, []
    while kills < 4 and not store.exists():
        before = partial.stat().st_mtime_ns if partial.exists() else None
        process = subprocess.Popen(
            _extract_command(config), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            if partial.exists() and partial.stat().st_mtime_ns != before:
                break  # this run is writing rows now
            time.sleep(0.005)
        # A random moment while rows are being written and progress is being marked
        # (every 0.5 s), long before the run could finish.
        time.sleep(rng.uniform(0.6, 1.5))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.wait(timeout=60)
        if not store.exists():
            with h5py.File(partial, "r", locking=False) as f:  # readable after every kill
                progress_seen.append(int(f["progress"][0]))
    assert kills >= 3, f"only {kills} kills landed during the run; the test proves nothing"
    assert progress_seen[-1] > progress_seen[0] > 0, progress_seen  # each rerun resumed
    if not store.exists():
        subprocess.run(_extract_command(config), check=True, capture_output=True, timeout=300)
    assert not partial.exists()
    assert_same_store(store, tmp_path / "reference" / "out" / "train.h5")


@pytest.mark.slow
def test_with_default_chunks_a_killed_run_keeps_whole_chunks(tmp_path):
    # Default chunking: layer1 rows ([64, 8, 8] float16, 8 KiB) go 128 to a chunk, those of
    # layer3, index, ids and labels 256: a mark counts whole chunks of every dataset, so
    # the durable rows are a multiple of 256, and a kill loses at most the 256 rows of
    # the chunks being filled. Batches of 24 never end on a multiple of 256 below 768.
    config = dict(KILL_CONFIG, store={}, loader={"batch_size": 24, "num_workers": 0})
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(dict(config, output={"dir": str(tmp_path / "out")})))
    store = tmp_path / "out" / "train.h5"
    process = subprocess.Popen(
        _extract_command(config_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    durable, deadline = 0, time.monotonic() + 120
    while not durable and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
        durable = durable_rows(partial_path(store))
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert not store.exists(), "the run finished before it was killed; the test proves nothing"
    assert durable > 0 and durable % 256 == 0
    partial = FeatureStore(store, allow_incomplete=True)
    assert partial.rows_written >= durable and partial.rows_written % 256 == 0
    with h5py.File(partial.path, "r", locking=False) as f:
        assert f["features/layer1"].chunks[0] == 128 and f["index"].chunks[0] == 256
    partial.close()
    subprocess.run(_extract_command(config_path), check=True, capture_output=True, timeout=300)
    resumed = FeatureStore(store)
    assert len(resumed) == 6000 and np.array_equal(resumed.index, np.arange(6000))


class Flaky(torch.utils.data.Dataset):
    """40 deterministic images; reading row ``fail_at`` raises, as a crash mid-run would."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.ids = [f"flaky/{i}" for i in range(40)]

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == self.fail_at:
            raise RuntimeError("simulated crash")
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 32, 32, generator=g), i % 3


LAYERS = [{"name": "layer2"}, {"name": "layer4", "reduce": "avg"}]
OPTIONS = {"batch_size": 6, "chunk_rows": 4, "progress": False, "num_workers": 0}


def test_resume_after_failure_equals_uninterrupted(resnet18, tmp_path):
    reference = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "ref.h5", **OPTIONS)
    path = tmp_path / "s.h5"
    with pytest.raises(FeatcacheError, match="simulated crash"):
        featcache.extract(resnet18, Flaky(fail_at=27), LAYERS, path, **OPTIONS)
    assert not path.exists() and partial_path(path).exists()
    partial = FeatureStore(path, allow_incomplete=True)
    assert not partial.complete and partial.rows_written == 24  # four batches of 6
    assert len(partial) == 24 and partial.ids == [f"flaky/{i}" for i in range(24)]
    partial.close()
    resumed = featcache.extract(resnet18, Flaky(), LAYERS, path, **OPTIONS)
    assert resumed.complete and not partial_path(path).exists()
    assert_same_store(path, reference.path)


class Skipping(Flaky):
    """Flaky's images, with rows 3 and 17 unreadable (skipped with on_error=skip)."""

    def __getitem__(self, i):
        if i in (3, 17):
            raise OSError("unreadable on purpose")
        return super().__getitem__(i)


def test_a_run_stopped_while_moving_its_store_into_place_resumes(resnet18, tmp_path, monkeypatch):
    """The store is complete and sealed in its .partial file when the last rename fails
    (a kill in the durable rename, a full disk): the rerun completes it, skip records and
    all, instead of failing on the /skipped group the first run wrote."""
    options = {**OPTIONS, "on_error": "skip"}
    with pytest.warns(UserWarning, match="2 of 40 samples skipped"):
        reference = featcache.extract(resnet18, Skipping(), LAYERS, tmp_path / "ref.h5", **options)
    path = tmp_path / "s.h5"
    original = store_writer.replace_durably

    def stopped(source, target):  # the store's move into place, not the new file's
        if Path(target) == path:
            raise OSError(5, "Input/output error")
        return original(source, target)

    monkeypatch.setattr(store_writer, "replace_durably", stopped)
    with pytest.raises(OSError, match="Input/output error"):
        featcache.extract(resnet18, Skipping(), LAYERS, path, **options)
    assert not path.exists() and partial_path(path).exists()
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="2 of 40 samples skipped"):
        featcache.extract(resnet18, Skipping(), LAYERS, path, **options)
    assert_same_store(path, reference.path)
    assert FeatureStore(path).skipped == FeatureStore(reference.path).skipped


def test_an_interrupted_overwrite_resumes_when_its_command_is_rerun(resnet18, tmp_path):
    """A .partial beside a complete store is an --overwrite that stopped: the plain rerun
    (the command featcache info prints) finishes it and then replaces the old store; a
    run of other settings still finds the store in place."""
    path = tmp_path / "s.h5"
    old = featcache.extract(resnet18, Flaky(), LAYERS[:1], path, **OPTIONS)
    old_rows = old.read("layer2")
    old.close()
    with pytest.raises(FeatcacheError, match="simulated crash"):
        featcache.extract(resnet18, Flaky(fail_at=27), LAYERS, path, overwrite=True, **OPTIONS)
    assert torch.equal(FeatureStore(path).read("layer2"), old_rows)  # the old store stays
    reference = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "ref.h5", **OPTIONS)
    with pytest.raises(ConfigError, match="store already exists"):  # other settings
        featcache.extract(resnet18, Flaky(), LAYERS[1:], path, **OPTIONS)
    featcache.extract(resnet18, Flaky(), LAYERS, path, **OPTIONS)
    assert_same_store(path, reference.path)
    assert not partial_path(path).exists()


def test_resume_refuses_a_partial_store_made_differently(resnet18, tmp_path):
    path = tmp_path / "s.h5"
    with pytest.raises(FeatcacheError):
        featcache.extract(resnet18, Flaky(fail_at=20), LAYERS, path, **OPTIONS)
    with pytest.raises(ConfigError, match="cannot resume .*store dtype differs.*--overwrite"):
        featcache.extract(resnet18, Flaky(), LAYERS, path, **{**OPTIONS, "dtype": "float32"})
    with pytest.raises(ConfigError, match="cannot resume .*taps differs"):
        featcache.extract(resnet18, Flaky(), ["layer1"], path, **OPTIONS)
    import torchvision

    torch.manual_seed(1)
    retrained = torchvision.models.resnet18().eval()
    with pytest.raises(ConfigError, match="cannot resume .*weights differs"):
        featcache.extract(retrained, Flaky(), LAYERS, path, **OPTIONS)
    other = Flaky()
    other.ids = [f"other/{i}" for i in range(40)]
    with pytest.raises(ConfigError, match="cannot resume .*dataset fingerprint differs"):
        featcache.extract(resnet18, other, LAYERS, path, **OPTIONS)
    store = featcache.extract(
        resnet18, Flaky(), LAYERS, path, **{**OPTIONS, "dtype": "float32", "overwrite": True}
    )
    assert store.complete and store.dtype("layer2") == torch.float32


def test_full_disk_keeps_a_resumable_store(resnet18, tmp_path, monkeypatch):
    reference = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "ref.h5", **OPTIONS)
    writes = {"n": 0}
    original = store_writer._Column._write

    def write(self, values, entries=None):  # the whole chunks of the layers, as written
        if self.name.startswith("/features/"):
            writes["n"] += 1
            if writes["n"] > 9:
                raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, values, entries)

    monkeypatch.setattr(store_writer._Column, "_write", write)
    path = tmp_path / "s.h5"
    with pytest.raises(FeatcacheError, match="disk full while writing .*s.h5; free space"):
        featcache.extract(resnet18, Flaky(), LAYERS, path, **OPTIONS)
    monkeypatch.undo()
    durable = FeatureStore(path, allow_incomplete=True).rows_written
    assert 0 < durable < 40
    featcache.extract(resnet18, Flaky(), LAYERS, path, **OPTIONS)
    assert_same_store(path, reference.path)


def test_partial_store_is_found_by_readers_and_info(resnet18, tmp_path):
    path = tmp_path / "s.h5"
    with pytest.raises(FeatcacheError):
        featcache.extract(resnet18, Flaky(fail_at=13), LAYERS, path, **OPTIONS)
    with pytest.raises(
        FeatcacheError, match="incomplete .12 rows written, in s.h5.partial.; rerun"
    ):
        FeatureStore(path)
    dataset = featcache.FeatureDataset(path, "layer2", allow_incomplete=True)
    assert len(dataset) == 12
    from typer.testing import CliRunner

    from featcache.commands.app import app

    result = CliRunner().invoke(app, ["info", str(path)])
    assert result.exit_code == 0 and "INCOMPLETE (12 rows durable)" in result.stdout
    assert os.path.basename(partial_path(path)) in result.stdout


def test_a_refused_resume_names_the_config_keys_that_differ(tmp_path):
    from PIL import Image

    folder = tmp_path / "images" / "train" / "things"
    folder.mkdir(parents=True)
    for i in range(10):
        Image.new("RGB", (24, 24), (i * 20, 0, 0)).save(folder / f"{i}.png")
    (folder / "9.png").write_bytes(b"not a png")  # the run stops here, rows 0-7 durable
    config = {
        "model": {"name": "resnet18"},
        "layers": [{"name": "layer1", "reduce": "avg"}],
        "data": {"root": str(tmp_path / "images")},
        "preprocess": {"resize": 32},
        "loader": {"batch_size": 4, "num_workers": 0},
        "output": {"dir": str(tmp_path / "out")},
        "runtime": {"progress": False},
    }
    with pytest.raises(FeatcacheError, match="cannot decode"):
        featcache.extract_from_config(config)
    store = tmp_path / "out" / "train.h5"
    assert partial_path(store).exists()
    with pytest.raises(
        ConfigError,
        match=r"its config differs from this run's at layers and preprocess.resize \(\[\{",
    ):
        featcache.extract_from_config(
            config, ["preprocess.resize=40", "layers=[{name: layer2, reduce: avg}]"]
        )
    with pytest.raises(ConfigError, match=r"at preprocess.resize \(32 vs 40\); pass --overwrite"):
        featcache.extract_from_config(config, ["preprocess.resize=40"])


def test_a_chunk_torn_after_the_last_mark_is_written_again(resnet18, tmp_path):
    """A run that dies while it writes a chunk past its last mark (a power cut mid-write)
    leaves that chunk and its checksum torn: nothing durable is in it, and the rerun
    writes it whole again, as every chunk past the mark."""
    options = {**OPTIONS, "chunk_rows": 5}  # four batches of 6: 24 rows, 20 in whole chunks
    reference = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "ref.h5", **options)
    path = tmp_path / "s.h5"
    with pytest.raises(FeatcacheError, match="simulated crash"):
        featcache.extract(resnet18, Flaky(fail_at=27), LAYERS, path, **options)
    partial = partial_path(path)
    assert durable_rows(partial) == 20
    for name in ("features/layer2", "features/layer4", "labels", "index", "ids"):
        overwrite_chunk(partial, name, 22)
    featcache.extract(resnet18, Flaky(), LAYERS, path, **options)
    assert_same_store(path, reference.path)


@pytest.mark.parametrize("name", ["features/layer2", "index"])
def test_damaged_durable_rows_are_refused_by_the_resume(resnet18, tmp_path, name):
    """A changed byte among the durable rows is no crash's doing (a crash never writes a
    durable chunk again): the resume checks every durable chunk, refuses in one line
    naming the rows, before any row is written; --overwrite starts over."""
    options = {**OPTIONS, "chunk_rows": 5}
    path = tmp_path / "s.h5"
    with pytest.raises(FeatcacheError, match="simulated crash"):
        featcache.extract(resnet18, Flaky(fail_at=27), LAYERS, path, **options)
    partial = partial_path(path)
    with h5py.File(partial, "r", locking=False) as f:
        info = f[name].id.get_chunk_info_by_coord((5, *(0 for _ in f[name].shape[1:])))
    raw = bytearray(partial.read_bytes())
    raw[info.byte_offset + 3] ^= 0x10  # inside row 5, durable
    partial.write_bytes(raw)
    before = partial.read_bytes()
    with pytest.raises(
        FeatcacheError, match=r"cannot resume .* rows 5-9 fail their checksum; pass --ov"
    ):
        featcache.extract(resnet18, Flaky(), LAYERS, path, **options)
    assert partial.read_bytes() == before
    reference = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "ref.h5", **options)
    featcache.extract(resnet18, Flaky(), LAYERS, path, overwrite=True, **options)
    assert_same_store(path, reference.path)


def test_a_partial_store_reads_its_durable_rows_whatever_lies_past_them(resnet18, tmp_path):
    """Before the rerun, a partial store whose chunks past the last mark are torn still
    reads: info, verify --quick and the readers give the 20 durable rows as an
    uninterrupted run wrote them. A changed durable byte is named by each."""
    from typer.testing import CliRunner

    from featcache.commands.app import app

    reference = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "ref.h5", **OPTIONS_5)
    partial = _crashed_at_24(resnet18, tmp_path / "s.h5")
    for name in ("features/layer2", "features/layer4", "labels", "index", "ids"):
        overwrite_chunk(partial, name, 20)
    info = CliRunner().invoke(app, ["info", str(partial)])
    assert info.exit_code == 0 and "INCOMPLETE (20 rows durable)" in info.stdout
    quick = CliRunner().invoke(app, ["verify", "--quick", str(partial)])
    assert "ok    checksums  the durable rows match their chunks' checksums" in quick.stdout
    assert quick.exit_code == 1 and (
        f"FAIL  complete   only 20 rows written; featcache info {partial} shows the command"
        in quick.stdout
    )
    with (
        FeatureStore(reference.path) as expected,
        FeatureStore(partial, allow_incomplete=True) as store,
    ):
        assert torch.equal(store.read("layer2"), expected.read("layer2", slice(0, 20)))
        assert store.ids == expected.ids[:20]
        assert np.array_equal(store.labels, expected.labels[:20])
        layer4 = expected.read("layer4", slice(0, 20))
    dataset = featcache.FeatureDataset(partial, ["layer4"], allow_incomplete=True)
    batches = list(dataset.batches(7, shuffle=False, with_index=True))
    dataset.close()
    assert torch.equal(torch.cat([b[2] for b in batches]), torch.arange(20))
    assert torch.equal(torch.cat([b[0]["layer4"] for b in batches]).half(), layer4)

    with h5py.File(partial, "r", locking=False) as f:
        info_15 = f["features/layer4"].id.get_chunk_info_by_coord((15, 0))
    raw = bytearray(partial.read_bytes())
    raw[info_15.byte_offset + 1] ^= 0x10  # inside row 15, durable
    partial.write_bytes(raw)
    quick = CliRunner().invoke(app, ["verify", "--quick", str(partial)])
    assert "FAIL  checksums  corrupted chunks: features/layer4 rows 15-19" in quick.stdout
    with (
        FeatureStore(partial, allow_incomplete=True) as store,
        pytest.raises(CorruptStoreError, match="layer4 rows 15-19"),
    ):
        store.read("layer4", [16])


def test_a_partial_store_whose_mark_counts_rows_never_written_is_refused(resnet18, tmp_path):
    """A progress mark that counts rows its datasets do not hold (a damaged /progress)
    would show them as rows of zeros with empty ids: readers and the resume refuse the
    store in one line; --overwrite starts over."""
    from typer.testing import CliRunner

    from featcache.commands.app import app

    reference = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "ref.h5", **OPTIONS_5)
    path = tmp_path / "s.h5"
    partial = _crashed_at_24(resnet18, path)
    with h5py.File(partial, "r+", locking=False) as f:
        f["progress"][0] = 26
    never = r"damaged: its progress mark counts 26 rows, but index holds 20 entries"
    with pytest.raises(CorruptStoreError, match=never):
        FeatureStore(partial, allow_incomplete=True)
    info = CliRunner().invoke(app, ["info", str(partial)])
    assert info.exit_code == 1 and "but index holds 20 entries" in info.output
    with pytest.raises(ConfigError, match="cannot resume .*counts 26 rows.*--overwrite"):
        featcache.extract(resnet18, Flaky(), LAYERS, path, **OPTIONS_5)
    featcache.extract(resnet18, Flaky(), LAYERS, path, overwrite=True, **OPTIONS_5)
    assert_same_store(path, reference.path)


def _crashed_at_24(resnet18, path: Path) -> Path:
    """The partial store of a run over Flaky, in chunks of 5 rows, stopped after 24 (20
    of them in whole chunks, durable)."""
    with pytest.raises(FeatcacheError, match="simulated crash"):
        featcache.extract(resnet18, Flaky(fail_at=27), LAYERS, path, **OPTIONS_5)
    return partial_path(path)


OPTIONS_5 = {**OPTIONS, "chunk_rows": 5}


def test_a_damaged_chunk_key_of_durable_rows_is_refused_by_the_resume(resnet18, tmp_path):
    """A changed byte in the index key of a durable chunk, which makes plain HDF5 read the
    chunk as never written: featcache's readers still read it right (they find chunks
    through HDF5's listing), but a resume refuses in one line, touching nothing."""
    path = tmp_path / "s.h5"
    partial = _crashed_at_24(resnet18, path)
    break_chunk_key(partial, "features/layer2", 5)
    before = partial.read_bytes()
    missed = r"layer layer2 rows 5-9 cannot be read by HDF5 \("
    with pytest.raises(ConfigError, match=rf"cannot resume from .*partial: {missed}.*--overwrite"):
        featcache.extract(resnet18, Flaky(), LAYERS, path, **OPTIONS_5)
    assert partial.read_bytes() == before
    reference = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "ref.h5", **OPTIONS_5)
    with FeatureStore(partial, allow_incomplete=True) as store:
        assert torch.equal(store.read("layer2"), reference.read("layer2", slice(0, 20)))


def test_a_resume_refuses_to_complete_a_store_whose_chunk_index_is_damaged(resnet18, tmp_path):
    """The same damage to a chunk the resume still has to write: featcache writes it at its
    place, but plain HDF5 would read zeros there. The resumed run fails instead of
    completing that store, naming the index; --overwrite starts over."""
    reference = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "ref.h5", **OPTIONS_5)
    path = tmp_path / "s.h5"
    partial = _crashed_at_24(resnet18, path)
    break_chunk_key(partial, "features/layer2", 35)
    with pytest.raises(
        CorruptStoreError,
        match=r"corrupted: layer layer2 rows 35-39 cannot be read by HDF5 .*--overw",
    ):
        featcache.extract(resnet18, Flaky(), LAYERS, path, **OPTIONS_5)
    assert not path.exists()
    featcache.extract(resnet18, Flaky(), LAYERS, path, overwrite=True, **OPTIONS_5)
    assert_same_store(path, reference.path)


def test_the_history_of_a_resumed_run_counts_what_it_computed_and_what_it_resumed(
    resnet18, tmp_path
):
    from typer.testing import CliRunner

    from featcache.commands.app import app
    from featcache.store.history import history_lines

    path = tmp_path / "s.h5"
    with pytest.raises(FeatcacheError, match="simulated crash"):
        featcache.extract(resnet18, Flaky(fail_at=27), LAYERS, path, **OPTIONS)
    resumed = featcache.extract(resnet18, Flaky(), LAYERS, path, **OPTIONS)
    record = resumed.attrs["history"][-1]
    assert (record["rows_computed"], record["rows_resumed"]) == (16, 24)  # 24 were durable
    info = CliRunner().invoke(app, ["info", str(path)])
    assert info.exit_code == 0, info.output
    line = "extract: computed 16 rows and 2 layers, reused 0 rows and 0 layers"
    assert f"{line}, resumed 24 rows a stopped run wrote" in info.stdout
    # A record of an older store has no rows_resumed: it reads as it did.
    old = {key: value for key, value in record.items() if key != "rows_resumed"}
    assert history_lines([old])[0].endswith(line)
    fresh = featcache.extract(resnet18, Flaky(), LAYERS, tmp_path / "fresh.h5", **OPTIONS)
    record = fresh.attrs["history"][-1]
    assert (record["rows_computed"], record["rows_resumed"]) == (40, 0)


def test_info_of_a_partial_that_does_not_exist_says_so(resnet18, tmp_path):
    """Not the complete store of the same name instead: one line, and a non-zero exit."""
    from typer.testing import CliRunner

    from featcache.commands.app import app

    path = tmp_path / "s.h5"
    featcache.extract(resnet18, Flaky(), LAYERS, path, **OPTIONS)
    result = CliRunner().invoke(app, ["info", str(partial_path(path))])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == (
        f"featcache: error: {partial_path(path)} does not exist: no run of {path} is stopped "
        f"or running; for the store, run `featcache info {path}`"
    )
    nothing = CliRunner().invoke(app, ["info", str(tmp_path / "none.h5.partial")])
    assert nothing.exit_code == 2 and "none.h5.partial does not exist" in nothing.stderr

"""Shards of any number of processes: sharing the missing rows, sealing stopped shards,
and going on from them with another number of processes (in one interpreter)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

import featcache
from featcache.commands.app import app
from featcache.errors import ConfigError, FeatcacheError
from featcache.extraction.distributed import block, parse_shard, share_rows
from featcache.extraction.planning import plan as plan_run
from featcache.store import FeatureStore
from featcache.store import writer as store_writer
from featcache.store.shards import missing_rows, read_shards, uncovered
from tests.golden import rows_of
from tests.texts import write_text_config


def rows_in(shares: list[list[range]]) -> list[int]:
    return sorted(i for share in shares for part in share for i in part)


def test_the_missing_rows_are_shared_once_in_whole_batches_as_evenly_as_they_go():
    missing = [range(48, 96), range(160, 173), range(208, 224)]
    for world in range(1, 6):
        shares = share_rows(missing, world, 16)
        assert rows_in(shares) == [i for part in missing for i in part]
        batches = [len([r for part in share for r in range(part.start, part.stop, 16)])
                   for share in shares]  # fmt: skip
        assert max(batches) - min(batches) <= 1
        for share in shares:
            assert all(part.start % 16 == 0 for part in share)
    # All rows missing: the blocks of a fresh run, one contiguous run each.
    assert [block(70, 16, r, 3) for r in range(3)] == [range(0, 16), range(16, 48), range(48, 70)]


def test_a_sharded_source_is_shared_at_its_shard_edges():
    starts = [50, 100, 150]
    shares = share_rows([range(0, 120), range(150, 200)], 2, 8, starts)
    assert shares == [[range(0, 100)], [range(100, 120), range(150, 200)]]
    assert rows_in(share_rows([range(0, 200)], 3, 8, starts)) == list(range(200))


def test_rows_without_the_held_blocks():
    held = [range(0, 10), range(20, 30), range(45, 60)]
    assert uncovered(range(5, 50), held) == [range(10, 20), range(30, 45)]
    assert uncovered(range(0, 10), held) == []
    assert uncovered(range(60, 70), held) == [range(60, 70)]


def test_a_shard_is_one_of_n_with_an_index_below_n():
    assert parse_shard("2/4").rank == 2 and parse_shard("2/4").world_size == 4
    assert not parse_shard("0/1").group
    for bad in ("4/4", "-1/4", "1", "a/b", "1/0"):
        with pytest.raises(ConfigError, match="give I/N with 0 <= I < N"):
            parse_shard(bad)


@contextlib.contextmanager
def failing_after(monkeypatch: pytest.MonkeyPatch, appends: int) -> Iterator[None]:
    """Every store writer of this process fails at its ``appends``-th batch, as a process
    stopped part way would (what was durable stays in its ``.partial``)."""
    calls = {"n": 0}
    append = store_writer.StoreWriter.append

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] >= appends:
            raise RuntimeError("stopped part way")
        return append(self, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(store_writer.StoreWriter, "append", failing)
        yield


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> tuple[dict, Path]:
    """A per-token text config (small chunks, so that a stopped run keeps rows) and the
    one-process store it makes."""
    folder = tmp_path_factory.mktemp("texts")
    config = yaml.safe_load(write_text_config(folder).read_text())
    config["data"]["splits"] = {"train": "train.jsonl"}
    config["store"]["chunk_rows"] = 8
    reference = dict(config, output={"dir": str(folder / "reference")})
    return config, featcache.extract_from_config(reference)["train"].path


def test_per_token_shards_of_two_jobs_are_finished_by_one_process(texts, tmp_path, monkeypatch):
    config, reference = texts
    config = dict(config, output={"dir": str(tmp_path / "out")})
    store = tmp_path / "out" / "train.h5"
    with failing_after(monkeypatch, 3), pytest.raises(FeatcacheError, match="stopped part way"):
        featcache.extract_from_config(config, shard="0/2")
    assert featcache.extract_from_config(config, shard="1/2") == {}  # job 0's rows remain
    shards = read_shards(store, 8)
    assert len(shards) == 2 and shards[0].complete  # job 1 sealed the stopped one
    kept = sum(len(shard.held) for shard in shards)
    assert 30 < kept < 60 and missing_rows(shards, 60)
    assert plan_run(config, batches=1).rows_to_write == 60 - kept
    listing = CliRunner().invoke(app, ["info", str(store)])
    assert listing.exit_code == 0 and f"remaining: {60 - kept} rows" in listing.stdout
    done = featcache.extract_from_config(config)["train"]  # one process goes on from them
    assert len(done.attrs["shards"]) == 3
    expected, got = rows_of(reference), rows_of(done.path)
    assert sorted(expected) == sorted(got)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    # Per launch: job 1 computed its rows and kept those of the stopped job 0, the last
    # process computed the rest.
    history = done.attrs["history"]
    rows = [record["rows_computed"] + record["rows_resumed"] for record in history]
    assert rows == [kept, 60 - kept]
    assert history[-1]["rows_resumed"] == 0


def test_shard_jobs_refuse_overwrite_and_torchrun(texts, tmp_path, monkeypatch):
    config = dict(texts[0], output={"dir": str(tmp_path / "out"), "overwrite": True})
    with pytest.raises(ConfigError, match="--overwrite with --shard would let each job"):
        featcache.extract_from_config(config, shard="0/2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="under torchrun the ranks share the rows"):
        featcache.extract_from_config(config, shard="0/2")


def test_a_shard_made_with_other_settings_is_refused(texts, tmp_path):
    config = dict(texts[0], output={"dir": str(tmp_path / "out")})
    featcache.extract_from_config(config, shard="0/2")
    other = dict(config, loader=dict(config["loader"], batch_size=4))
    with pytest.raises(ConfigError, match=r"shard .*shard-000000000000.h5 was made with another"):
        featcache.extract_from_config(other, shard="1/2")
    assert FeatureStore(tmp_path / "out" / "train.shard-000000000000.h5").attrs["complete"]


def test_merge_combines_complete_shards_first(texts, tmp_path):
    config, reference = texts
    config = dict(config, output={"dir": str(tmp_path / "out")})
    store, single = tmp_path / "out" / "train.h5", tmp_path / "single.h5"
    featcache.extract_from_config(config, shard="1/2")
    early = CliRunner().invoke(app, ["merge", str(store), "-o", str(single)])
    assert early.exit_code == 2 and "no complete shard holds 32 of its rows" in early.stderr
    featcache.extract_from_config(config, shard="0/2")  # the last job combines the store
    store.unlink()  # as if the last two jobs had ended together, neither combining
    result = CliRunner().invoke(app, ["merge", str(store), "-o", str(single)])
    assert result.exit_code == 0, result.output
    expected, got = rows_of(reference), rows_of(single)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)

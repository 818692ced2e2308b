"""Write the small format-2 stores that the tests keep as fixtures, and the rows they hold.

Store format 2 (Fletcher-32 chunk checksums, written by featcache up to commit 5574a29)
must keep reading in later featcache versions. This script makes a few stores of that
format, each as featcache wrote them, gzips every file into ``--out`` (by default
``tests/fixtures/format2``) and records next to each store, in ``<name>.npz``, the rows
featcache read back from it at the time: every layer, labels, index, ids, token
offsets and ids, and the skip records. ``tests/test_format2.py`` reads the stores with
the current featcache and compares.

It only makes sense with the code that wrote format 2; run it from a checkout of
5574a29 (``git worktree add /tmp/fc2 5574a29``) with that checkout first on the path:

    PYTHONPATH=/tmp/fc2 python scripts/make_format2_fixtures.py --out tests/fixtures/format2

The stores (13 rows each unless said, 4 rows per chunk, a seeded conv net over 3x8x8
inputs with layers ``conv`` [4, 6, 6] and ``head`` [5]):

* ``dense_float16``, ``dense_bfloat16``, ``dense_float32``: one per stored dtype, with
  labels (the float32 one without);
* ``nochecksum``: float16 written with ``checksum=False`` (no filter at all);
* ``compressed``: float16 with ``compression="gzip"`` (gzip and Fletcher-32);
* ``skipped``: rows 3 and 8 give NaN and are left out (``on_nonfinite="skip"``);
* ``tokens``: per-token rows (a token model's ``reduce: none``), 9 rows, with token ids;
* ``combined``: a torchrun store, combined from two shard files (written each for its
  block of rows, as the ranks do) as virtual datasets, with its two shards beside it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

import featcache
from featcache.extraction.sharding import combined_key
from featcache.store import FeatureStore, combine_shards
from featcache.store.paths import shard_path

ROWS = 13
NAN_ROWS = (3, 8)


class ConvNet(nn.Module):
    """A seeded conv layer and a linear head over 3x8x8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


class TokenNet(nn.Module):
    """Seeded embeddings mixed by a linear layer: ``[B, T, 6]`` per-token outputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(40, 6)
        self.mix = nn.Linear(6, 6)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.mix(self.embed(input_ids)) * attention_mask[..., None].float()


class Images(torch.utils.data.Dataset):
    """``ROWS`` seeded 3x8x8 inputs with labels ``i % 3`` (none without ``labels``);
    the rows in ``nan_rows`` are NaN."""

    def __init__(self, labels: bool = True, nan_rows: tuple[int, ...] = ()) -> None:
        self.x = torch.randn(ROWS, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        self.x[list(nan_rows)] = float("nan")
        self.labels = labels
        self.ids = [f"img/{i:03d}.png" for i in range(ROWS)]

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int):
        return (self.x[i], i % 3) if self.labels else self.x[i]


class Tokens(torch.utils.data.Dataset):
    """9 rows of 1 to 7 token ids each, labels ``i % 2``."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(2)
        lengths = [3, 1, 7, 5, 2, 6, 4, 7, 2]
        self.items = [torch.randint(1, 40, (n,), generator=generator) for n in lengths]
        self.token_lengths = np.array(lengths)
        self.ids = [f"text-{i}" for i in range(len(lengths))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        ids = self.items[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, i % 2


LAYERS = [{"name": "conv"}, {"name": "head"}]
OPTIONS = {"batch_size": 4, "chunk_rows": 4, "num_workers": 0, "progress": False}


def write_stores(folder: Path) -> dict[str, list[Path]]:
    """Every fixture store in ``folder``: name -> its files (the store first)."""
    model = ConvNet()
    made: dict[str, list[Path]] = {}

    def dense(name: str, dataset: torch.utils.data.Dataset, **options) -> None:
        path = folder / f"{name}.h5"
        featcache.extract(model, dataset, LAYERS, path, **(OPTIONS | options))
        made[name] = [path]

    dense("dense_float16", Images(), dtype="float16")
    dense("dense_bfloat16", Images(), dtype="bfloat16")
    dense("dense_float32", Images(labels=False), dtype="float32")
    dense("nochecksum", Images(), dtype="float16", checksum=False)
    dense("compressed", Images(), dtype="float16", compression="gzip")
    dense("skipped", Images(nan_rows=NAN_ROWS), dtype="float16", on_nonfinite="skip")

    path = folder / "tokens.h5"
    tokens = [{"name": "mix", "reduce": "none"}, {"name": "mix", "reduce": "mean", "key": "mean"}]
    featcache.extract(TokenNet(), Tokens(), tokens, path, **(OPTIONS | {"dtype": "float32"}))
    made["tokens"] = [path]

    # A torchrun store: each rank's block into its shard, then the shards combined.
    path = folder / "combined.h5"
    shards = [shard_path(path, rank, 2) for rank in range(2)]
    for shard, rows in zip(shards, (range(0, 8), range(8, ROWS)), strict=True):
        store = featcache.extract(model, Images(), LAYERS, shard, rows=rows, **OPTIONS)
        shard_key = store.attrs["resume_key"]
        store.close()
    key = combined_key(_key(shard_key), ROWS, 2)
    combine_shards(path, shards, {"resume_key": key.to_json()}).close()
    made["combined"] = [path, *shards]
    return made


def _key(recorded: dict):
    from featcache.store.provenance import StoreKey

    recorded = dict(recorded, rows=tuple(recorded["rows"]), taps=tuple(recorded["taps"]))
    return StoreKey(**recorded)


def expected_rows(path: Path) -> dict[str, np.ndarray]:
    """What featcache reads from the store at ``path``: ``features/<layer>`` (rows of a
    dense layer as stored, bfloat16 as its uint16 bits; a per-token layer's tokens),
    ``labels``, ``index``, ``ids``, ``offsets``, ``token_ids``, ``skipped`` (JSON)."""
    out: dict[str, np.ndarray] = {}
    with FeatureStore(path) as store:
        for layer in store.layers:
            if store.is_per_token(layer):
                values, _ = store.read_tokens(layer)
            else:
                values = store.read(layer)
            if values.dtype == torch.bfloat16:
                values = values.view(torch.int16)
            out[f"features/{layer}"] = values.numpy()
        if store.labels is not None:
            out["labels"] = store.labels
        out["index"] = store.index
        out["ids"] = np.array(store.ids)
        if store.offsets is not None:
            out["offsets"] = store.offsets
        if store.token_ids is not None:
            out["token_ids"] = store.token_ids
        out["skipped"] = np.array(json.dumps(store.skipped))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/format2"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="featcache-format2-") as tmp:
        for name, files in write_stores(Path(tmp)).items():
            np.savez_compressed(args.out / f"{name}.npz", **expected_rows(files[0]))
            for file in files:
                with open(file, "rb") as raw, gzip.open(args.out / f"{file.name}.gz", "wb") as gz:
                    shutil.copyfileobj(raw, gz)
    for found in sorted(args.out.iterdir()):
        print(f"{found.stat().st_size:>8,}  {found}")


if __name__ == "__main__":
    main()

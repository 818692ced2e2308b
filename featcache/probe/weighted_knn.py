"""Weighted k-NN classification on stored features, as DINO evaluates a backbone (Wu et
al. 2018; Caron et al. 2021). The training rows are read in blocks against a running
top-``k`` (:func:`nearest`), so a store larger than memory is searched in one pass; every
``k`` comes from the one search for the largest."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from featcache.probe.full import READ_ROWS, read_layer
from featcache.probe.metrics import Moments, Scaling, rank, require_finite, topk_metrics
from featcache.probe.options import ProbeOptions
from featcache.probe.parts import Part, fit_and_val, in_order, open_datasets, progress
from featcache.probe.results import KnnFit, Timings
from featcache.probe.splits import Splits
from featcache.read.dataset import FeatureDataset

BLOCK_BYTES = 16 << 20  # training rows per block, as float32
TILE_BYTES = 32 << 20  # similarities of one tile of query rows against one block
Block = tuple[torch.Tensor, torch.Tensor]  # float32 rows [b, D], their positions int64 [b]


@torch.inference_mode()
def nearest(
    queries: torch.Tensor, blocks: Iterable[Block], k: int, *, tile_bytes: int = TILE_BYTES
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` training rows most similar to each query row, by dot product.

    ``queries``: float32 ``[M, D]`` on the device to search on (unit rows, for cosine
    similarity); ``blocks``: the training rows as ``(rows [b, D], positions [b])``, on
    any device (unit rows likewise), where ``positions`` number the training rows. Each
    block is compared with a tile of query rows at a time (at most ``tile_bytes`` of
    similarities) and merged into the running top-``k`` of each query row.

    Returns float32 similarities ``[M, k']`` (best first) and the int64 positions of those
    rows ``[M, k']``, on the queries' device; ``k'`` is ``k``, or the number of training
    rows when there are fewer."""
    device = queries.device
    best = queries.new_empty(len(queries), 0)
    where = torch.empty(len(queries), 0, dtype=torch.int64, device=device)
    for rows, positions in blocks:
        rows = rows.to(device, torch.float32, non_blocking=True)
        positions = positions.to(device, non_blocking=True)
        old = best.shape[1]
        width = min(k, old + len(rows))
        tile = max(1, tile_bytes // (4 * (old + len(rows))))
        new_best = queries.new_empty(len(queries), width)
        new_where = torch.empty(len(queries), width, dtype=torch.int64, device=device)
        for start in range(0, len(queries), tile):
            part = slice(start, start + tile)
            # The running best beside the block's similarities: one topk over both keeps
            # the k best of every row seen so far.
            scores = torch.cat([best[part], queries[part] @ rows.T], dim=1)
            top, index = scores.topk(width, dim=1)
            chosen = positions[(index - old).clamp_(min=0)]
            if old:
                before = where[part].gather(1, index.clamp(max=old - 1))
                chosen = torch.where(index < old, before, chosen)
            new_best[part], new_where[part] = top, chosen
        best, where = new_best, new_where
    return best, where


def vote(
    similarity: torch.Tensor,
    labels: torch.Tensor,
    ks: Sequence[int],
    temperature: float,
    num_classes: int,
) -> dict[int, torch.Tensor]:
    """Class votes of the nearest neighbours, for each ``k`` in ``ks``.

    ``similarity``: float32 ``[M, K]`` (best first); ``labels``: int64 ``[M, K]``, the
    neighbours' classes. Neighbour ``j`` of a row votes ``exp(s_j / T)`` for its class,
    computed as ``exp((s_j - s_0) / T)``: the same votes up to one factor per row, which
    no ranking sees, and no overflow at any temperature. Returns float32 votes
    ``[M, num_classes]`` per ``k`` (each ``k`` at most ``K``)."""
    weights = ((similarity - similarity[:, :1]) / temperature).exp_()
    zeros = similarity.new_zeros(len(similarity), num_classes)
    return {k: zeros.clone().scatter_add_(1, labels[:, :k], weights[:, :k]) for k in ks}


def classify(
    queries: torch.Tensor,
    blocks: Iterable[Block],
    labels: torch.Tensor,
    options: ProbeOptions,
    num_classes: int,
) -> dict[int, torch.Tensor]:
    """Ranked predictions (int64 ``[M, min(5, C)]``) of the query rows for each ``k`` of
    ``options.ks`` (at most the number of training rows); ``labels``: int64 classes of
    the training rows by position."""
    similarity, positions = nearest(queries, blocks, max(options.ks))
    similarity, positions = similarity.cpu(), positions.cpu()
    ks = sorted({min(k, similarity.shape[1]) for k in options.ks})
    votes = vote(similarity, labels[positions], ks, options.temperature, num_classes)
    return {k: rank(v) for k, v in votes.items()}


def knn_in_memory(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_query: torch.Tensor,
    options: ProbeOptions,
    scaling: Scaling,
    num_classes: int,
    device: torch.device,
) -> dict[int, torch.Tensor]:
    """:func:`classify` for training rows ``x_train`` float32 ``[N, D]`` (classes
    ``y_train`` ``[N]``) and queries ``x_query`` ``[M, D]`` in memory, prepared by
    ``scaling`` with the training rows' statistics."""
    x_train, x_query = scaling.rows(x_train), scaling.rows(x_query)
    mean, std = scaling.standardizer(Moments(x_train.shape[1]).update(x_train), device)
    train = F.normalize((x_train.to(device) - mean) / std, dim=1)
    queries = F.normalize((x_query.to(device) - mean) / std, dim=1)
    block = (train, torch.arange(len(train), device=device))
    return classify(queries, [block], y_train, options, num_classes)


def run_knn(
    splits: Splits,
    layer: str,
    options: ProbeOptions,
    device: torch.device,
    scaling: Scaling,
    streamed: bool,
) -> KnnFit:
    """k-NN on ``layer``: the train and val stores' rows are the neighbours of the test
    store's (without one, the fit rows those of the validation rows), read in blocks
    with ``streamed``, else loaded whole."""
    timings = Timings()
    with open_datasets(splits, layer) as datasets:
        neighbours = _Neighbours(_neighbour_parts(splits, datasets), splits, layer, scaling)
        with timings.phase("load"):
            x_query, y_query = _queries(splits, datasets, layer, neighbours.digests)
            x_query = scaling.rows(x_query)
        moments = Moments(x_query.shape[1])
        if scaling.standardize:
            with timings.phase("statistics"):
                for rows, _ in neighbours.rows(streamed):
                    moments.update(rows)
        mean, std = scaling.standardizer(moments, device)
        with timings.phase("neighbours"):
            queries = F.normalize((x_query.to(device) - mean) / std, dim=1)
            bar = {"desc": f"k-NN {layer}", "unit": "block", "leave": False}
            read = progress(options, neighbours.rows(streamed), **bar)
            blocks = (
                (F.normalize((rows.to(device) - mean) / std, dim=1), positions)
                for rows, positions in read
            )
            ranked = classify(queries, blocks, neighbours.labels, options, splits.num_classes)
        with timings.phase("votes"):
            metrics = {k: topk_metrics(r, y_query, splits.class_names) for k, r in ranked.items()}
    return KnnFit(metrics, len(neighbours), len(y_query), timings.seconds, neighbours.digests)


def _neighbour_parts(splits: Splits, datasets: dict[str, FeatureDataset]) -> list[tuple[str, Part]]:
    """The neighbour rows of each role: every store but the test store, else the fit rows."""
    if "test" in datasets:
        return [(role, Part(dataset)) for role, dataset in datasets.items() if role != "test"]
    return [("train", fit_and_val(splits, datasets)[0])]


def _queries(
    splits: Splits, datasets: dict[str, FeatureDataset], layer: str, digests: dict[str, str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The query rows, float32 ``[M, D]``, and their labels int64 ``[M]``: the test
    store's (its hash goes into ``digests``), else the validation rows."""
    if "test" in datasets:
        x, digests["test"] = read_layer(splits.stores["test"], layer)
        require_finite(x, f"the test store's features of layer {layer}")
        return x, torch.from_numpy(splits.labels["test"])
    xs, ys = [], []
    for _, x, y, _, _ in in_order([fit_and_val(splits, datasets)[1]], READ_ROWS):
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


class _Neighbours:
    """The neighbour rows of one k-NN run: read whole or in blocks, numbered across the
    stores, each store hashed on its first reading."""

    def __init__(self, parts: list[tuple[str, Part]], splits: Splits, layer: str, scaling: Scaling):
        self.parts, self.splits, self.layer, self.scaling = parts, splits, layer, scaling
        self.offsets = np.cumsum([0] + [len(part.dataset) for _, part in parts])
        self.labels = torch.cat([part.dataset.labels for _, part in parts])
        self.digests: dict[str, str] = {}
        self._whole: Block | None = None

    def __len__(self) -> int:
        return sum(len(part) for _, part in self.parts)

    def rows(self, streamed: bool) -> Iterator[Block]:
        """The rows after the per-row step (float32 ``[b, D]``) and their positions."""
        if not streamed:
            if self._whole is None:
                self._whole = self._load()
            yield self._whole
            return
        dim = int(np.prod(self.splits.stores["train"].shape(self.layer)))
        block = max(1, BLOCK_BYTES // (4 * dim))
        for (role, part), offset in zip(self.parts, self.offsets[:-1], strict=True):
            digest = None if role in self.digests else hashlib.sha256()
            for _, x, _, rows, raw in in_order([part], block, buffer_rows=block):
                if digest is not None:
                    digest.update(raw.reshape(len(raw), -1).numpy().data)
                require_finite(x, f"the {role} store's features of layer {self.layer}")
                yield self.scaling.rows(x), rows + int(offset)
            if digest is not None:
                self.digests[role] = digest.hexdigest()

    def _load(self) -> Block:
        xs, positions = [], []
        for (role, part), offset in zip(self.parts, self.offsets[:-1], strict=True):
            x, self.digests[role] = read_layer(self.splits.stores[role], self.layer)
            rows = torch.arange(len(x))
            if part.keep is not None:
                keep = torch.from_numpy(part.keep)
                x, rows = x[keep], rows[keep]
            require_finite(x, f"the {role} store's features of layer {self.layer}")
            xs.append(self.scaling.rows(x))
            positions.append(rows + int(offset))
        return torch.cat(xs), torch.cat(positions)

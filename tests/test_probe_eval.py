"""k-NN, few-shot probes, the published recipes and the normalisation options.

Stores are written with featcache.extract from seeded Gaussian class clusters (as in
test_probe.py); the k-NN checks compare with a brute-force reference computed here.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import featcache.probe.weighted_knn as knn_module
from featcache import FeatureStore
from featcache.commands.app import app
from featcache.errors import ConfigError
from featcache.probe import (
    FewShotResult,
    KnnResult,
    ProbeResult,
    draw_shots,
    evaluate,
    format_result,
    format_table,
    knn,
    nearest,
    plot_layers,
    probe,
    recipe,
    save_results,
    stratified_split,
    vote,
)
from featcache.probe.recipes import bisect_search
from tests.test_probe import CLASSES, _clusters, write_store

runner = CliRunner()


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """train (240 rows), val (60) and test (90) stores of six classes, one layer ``x``
    [2, 5] of overlapping clusters, in chunks of 16 rows."""
    tmp_path, out = tmp_path_factory.mktemp("eval"), {}
    for split, n, seed in (("train", 240, 1), ("val", 60, 2), ("test", 90, 3)):
        x, labels = _clusters(n, 10, 6, seed, spread=0.8)
        out[split] = write_store(
            tmp_path / f"{split}.h5",
            {"x": x.reshape(n, 2, 5)},
            labels,
            class_names=CLASSES,
            chunk_rows=16,
        )
    return out


def _rows(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    with FeatureStore(path) as store:
        return store.read("x").reshape(len(store), -1).double(), torch.from_numpy(store.labels)


def _brute_force(
    train: torch.Tensor, labels: torch.Tensor, queries: torch.Tensor, k: int, t: float, c: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference: the k nearest rows by cosine (a full sort of every similarity)
    and each class's summed exp(similarity / t) over them."""
    similarity = (
        torch.nn.functional.normalize(queries, dim=1)
        @ torch.nn.functional.normalize(train, dim=1).T
    )
    order = similarity.argsort(dim=1, descending=True)[:, :k]
    top = similarity.gather(1, order)
    votes = torch.zeros(len(queries), c, dtype=torch.float64)
    votes.scatter_add_(1, labels[order], (top / t).exp())
    return order, votes


def _metrics(votes: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    ranked = votes.topk(5, dim=1).indices
    top1 = (ranked[:, 0] == labels).double().mean().item()
    return top1, (ranked == labels[:, None]).any(1).double().mean().item()


def test_nearest_and_votes_equal_a_brute_force_reference():
    generator = torch.Generator().manual_seed(0)
    train = torch.randn(137, 9, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 4, (137,), generator=generator)
    queries = torch.randn(23, 9, generator=generator, dtype=torch.float64)
    unit = torch.nn.functional.normalize
    expected, reference = _brute_force(train, labels, queries, 20, 0.07, 4)
    q, x = unit(queries).float(), unit(train).float()
    positions = torch.arange(len(x))
    sizes = [1, 30, 7, 64, 35]  # uneven blocks, one smaller than k, one of a single row
    blocks = list(zip(x.split(sizes), positions.split(sizes), strict=True))
    for tile_bytes in (4, 1 << 20):  # one query row per tile, and all of them
        similarity, found = nearest(q, blocks, 20, tile_bytes=tile_bytes)
        assert torch.equal(found, expected)
        in_one = nearest(q, [(x, positions)], 20)
        assert torch.equal(in_one[1], expected) and torch.allclose(in_one[0], similarity)
    votes = vote(similarity, labels[found], [1, 5, 20], 0.07, 4)
    # The votes are exp(s / T) up to the factor exp(-s_0 / T) of each row.
    scale = (similarity[:, :1].double() / 0.07).exp()
    torch.testing.assert_close(votes[20].double() * scale, reference, rtol=1e-4, atol=0)
    assert torch.equal(votes[1].argmax(1), labels[expected[:, 0]])
    # Fewer rows than k: every row is a neighbour.
    few, where = nearest(q, blocks[:2], 200)
    assert few.shape == (23, 31) and sorted(where[0].tolist()) == list(range(31))
    # No temperature overflows: a tiny one leaves the nearest neighbour's class winning.
    tiny = vote(similarity, labels[found], [20], 1e-4, 4)[20]
    assert torch.isfinite(tiny).all() and torch.equal(tiny.argmax(1), labels[expected[:, 0]])


@pytest.mark.parametrize("normalize", ["l2", "standardize"])
def test_knn_on_stores_equals_the_reference_streamed_or_in_memory(stores, monkeypatch, normalize):
    train, train_labels = _rows(stores["train"])
    val, val_labels = _rows(stores["val"])
    test, test_labels = _rows(stores["test"])
    neighbours = torch.cat([train, val])  # with a test store, val rows are neighbours too
    labels = torch.cat([train_labels, val_labels])
    if normalize == "standardize":
        mean, std = neighbours.mean(0), neighbours.std(0, unbiased=False)
        neighbours, test = (neighbours - mean) / std, (test - mean) / std
    kwargs = {"val": stores["val"], "test": stores["test"], "ks": [1, 20, 500]}
    kwargs |= {"normalize": normalize, "progress": False}
    in_memory = knn(stores["train"], "x", trainer="full", **kwargs)
    # Blocks of 24 rows: the train store's 240 rows in 10, the val store's 60 in 3.
    monkeypatch.setattr(knn_module, "BLOCK_BYTES", 4 * 10 * 24)
    streamed = knn(stores["train"], "x", trainer="streaming", **kwargs)
    assert isinstance(in_memory, KnnResult) and in_memory.ks == [1, 20, 300]
    assert in_memory.n_train == 300 and in_memory.n_test == 90 and in_memory.scored == "test"
    assert in_memory.metrics == streamed.metrics
    assert in_memory.stores == streamed.stores  # the same rows hashed either way
    assert "k is at most the 300 neighbour rows" in in_memory.notes
    for k in (1, 20, 300):
        _, votes = _brute_force(neighbours, labels, test, k, 0.07, 6)
        top1, top5 = _metrics(votes, test_labels)
        assert in_memory.metrics[k]["top1"] == pytest.approx(top1)
        assert in_memory.metrics[k]["top5"] == pytest.approx(top5)
    assert in_memory.metrics[20]["top1"] > 0.5 and in_memory.top1 == in_memory.metrics[20]["top1"]


def test_knn_without_a_test_store_scores_the_held_out_rows(stores):
    result = knn(stores["train"], "x", ks=[5], progress=False)
    assert (result.n_train, result.n_test, result.scored) == (192, 48, "val")
    assert "0.2 of train" in result.validation
    x, y = _rows(stores["train"])
    fit, held = stratified_split(y.numpy(), 0.2, 0)
    _, votes = _brute_force(x[fit], y[fit], x[held], 5, 0.07, 6)
    assert result.metrics[5]["top1"] == pytest.approx(_metrics(votes, y[held])[0])
    assert set(result.stores) == {"train"} and len(result.stores["train"]["features_sha256"]) == 64


def test_draws_are_seeded_per_class_and_nested():
    labels = np.repeat(np.arange(3), [10, 6, 4])
    candidates = np.flatnonzero(np.arange(20) % 5 != 0)  # 16 rows to draw from
    five = draw_shots(labels, candidates, 3, draw=0, seed=7)
    assert np.bincount(labels[five]).tolist() == [3, 3, 3] and set(five) <= set(candidates)
    assert np.array_equal(five, draw_shots(labels, candidates, 3, draw=0, seed=7))
    assert not np.array_equal(five, draw_shots(labels, candidates, 3, draw=1, seed=7))
    assert set(draw_shots(labels, candidates, 1, draw=0, seed=7)) <= set(five)
    with pytest.raises(ConfigError, match="class 1 has 4 rows to draw 5 shots from"):
        draw_shots(labels, candidates, 5, draw=0, seed=7)


def test_few_shot_reports_every_draw_and_its_spread(stores):
    options = {"shots": [1, 4], "draws": 3, "methods": "linear,knn", "progress": False}
    options |= {"lambdas": [1e-3, 1e-1], "refine": 0, "max_iter": 100}  # two short fits
    results = evaluate(stores["train"], "x", test=stores["test"], ks=[1, 3], **options)
    assert [(r.method, r.shots) for r in results] == [
        ("linear", 1),
        ("linear", 4),
        ("knn", 1),
        ("knn", 4),
    ]
    assert all(isinstance(r, FewShotResult) and r.n_test == 90 for r in results)
    linear, _, knn_1, knn_4 = results
    assert [d["rows"] for d in linear.draws] == [6, 6, 6] and linear.n_val == 48
    top1 = [d["top1"] for d in linear.draws]
    assert linear.summary["linear"]["top1"]["mean"] == pytest.approx(np.mean(top1))
    assert linear.summary["linear"]["top1"]["std"] == pytest.approx(np.std(top1, ddof=1))
    assert (
        set(knn_1.summary) == {"k=1", "k=3"} and knn_1.top1 == knn_1.summary["k=1"]["top1"]["mean"]
    )
    # A draw of k-NN equals the reference on the drawn rows.
    x, y = _rows(stores["train"])
    test, test_labels = _rows(stores["test"])
    fit, _ = stratified_split(y.numpy(), 0.2, 0)
    rows = draw_shots(y.numpy(), fit, 4, draw=2, seed=0)
    _, votes = _brute_force(x[rows], y[rows], test, 3, 0.07, 6)
    assert knn_4.draws[2]["k"][3]["top1"] == pytest.approx(_metrics(votes, test_labels)[0])
    again = evaluate(stores["train"], "x", test=stores["test"], ks=[1, 3], **options)
    assert [r.draws for r in again] == [r.draws for r in results]
    assert knn_4.summary["k=3"]["top1"]["mean"] > knn_1.summary["k=3"]["top1"]["mean"] - 0.05


def test_dinov3_recipe_equals_sklearn_with_the_same_grid(stores):
    linear_model = pytest.importorskip("sklearn.linear_model")
    result = probe(stores["train"], "x", test=stores["test"], recipe="dinov3", progress=False)
    published = recipe("dinov3")
    assert published is not None and len(published.values) == 45
    assert result.recipe == "dinov3" and result.normalize == "none"
    assert (result.n_train, result.n_val) == (216, 24)  # 10% of each class held out
    cs = [entry["C"] for entry in result.sweep]
    assert sorted(cs) == pytest.approx(list(published.values))
    assert cs[0] == pytest.approx(1e5) and cs[-1] == pytest.approx(1e-6)  # increasing lambda
    x, y = (t.numpy() for t in _rows(stores["train"]))
    x_test, y_test = (t.numpy() for t in _rows(stores["test"]))
    fit, held = stratified_split(y, 0.1, 0)
    scores = []
    for c in published.values:
        model = linear_model.LogisticRegression(C=c, max_iter=1000, tol=1e-12)
        scores.append((model.fit(x[fit], y[fit]).predict(x[held]) == y[held]).mean())
    chosen = published.values[int(np.argmax(scores))]
    final = linear_model.LogisticRegression(C=chosen, max_iter=1000, tol=1e-12).fit(x, y)
    reference = (final.predict(x_test) == y_test).mean()
    ours = [e["val_top1"] for e in sorted(result.sweep, key=lambda e: e["C"])]
    assert np.abs(np.array(ours) - np.array(scores)).max() <= 1 / 24 + 1e-9  # one row at most
    assert abs(result.test["top1"] - reference) <= 0.005 + 1 / 90  # 0.5 points, or one row
    # The returned model is the refit on raw features at lambda = 1 / (C * N).
    assert result.model is not None and result.model.std.eq(1).all()
    predicted = result.model.predict(torch.from_numpy(x_test))
    assert (predicted.numpy() == y_test).mean() == pytest.approx(result.test["top1"])


def test_clip_recipe_runs_the_published_search(stores):
    visited: list[list[int]] = []

    def evaluate_positions(positions: list[int]) -> list[float]:
        visited.append(positions)
        return [-abs(p - 40) for p in positions]  # peak at grid position 40

    assert bisect_search(97, evaluate_positions) == 40
    assert visited == [
        [0, 16, 32, 48, 64, 80, 96],
        [24, 32, 40],
        [36, 40, 44],
        [38, 40, 42],
        [39, 40, 41],
    ]
    assert bisect_search(97, lambda ps: [1.0] * len(ps)) == 0  # ties: the first tried
    result = probe(stores["train"], "x", test=stores["test"], recipe="clip", progress=False)
    assert result.recipe == "clip" and result.normalize == "l2" and result.n_val == 24
    published = recipe("clip")
    assert published is not None and len(published.values) == 97
    decays = [entry["weight_decay"] for entry in result.sweep]
    assert 7 <= len(decays) <= 7 + 4 * 2 and set(decays) <= set(published.values)
    assert all(entry["epochs"] == 20 for entry in result.sweep)
    assert result.test is not None and result.test["top1"] > 0.5
    assert result.model is not None and result.model.l2
    x_test, y_test = _rows(stores["test"])
    predicted = result.model.predict(x_test.float())
    assert (predicted == y_test).double().mean().item() == pytest.approx(result.test["top1"])
    text = format_result(result)
    assert "recipe     clip: CLIP_benchmark" in text and "normalize  l2" in text


@pytest.mark.parametrize("normalize", ["l2", "l2+standardize", "none"])
def test_normalize_is_applied_by_both_trainers_and_recorded(stores, normalize):
    kwargs = {"val": stores["val"], "test": stores["test"], "normalize": normalize}
    kwargs |= {"lambdas": [1e-2], "refine": 0, "progress": False}
    full = probe(stores["train"], "x", trainer="full", **kwargs)
    streamed = probe(stores["train"], "x", trainer="streaming", epochs=4, batch_size=64, **kwargs)
    for result in (full, streamed):
        assert result.normalize == normalize and result.to_dict()["normalize"] == normalize
        assert result.model is not None and result.model.l2 == normalize.startswith("l2")
        assert result.test is not None and result.test["top1"] > 0.5
        x_test, y_test = _rows(stores["test"])
        accuracy = (result.model.predict(x_test.float()) == y_test).double().mean().item()
        assert accuracy == pytest.approx(result.test["top1"])
    if normalize == "none":
        assert full.model is not None and full.model.mean.eq(0).all()
    assert abs(full.test["top1"] - streamed.test["top1"]) < 0.1  # type: ignore[index]
    assert f"normalize  {normalize}" in format_result(full)


def test_few_shot_json_names_the_rows_each_draw_trained_on(stores, tmp_path):
    options = {"shots": [2, 3], "draws": 2, "methods": "knn", "ks": [3], "progress": False}
    results = evaluate(stores["train"], "x", test=stores["test"], **options)
    path = save_results(results, tmp_path / "few.json")
    entries = json.loads(path.read_text())["results"]
    x, y = _rows(stores["train"])
    test, test_labels = _rows(stores["test"])
    with FeatureStore(stores["train"]) as store:
        ids = store.ids
    fit, _ = stratified_split(y.numpy(), 0.2, 0)
    for entry in entries:
        for draw in entry["draws"]:
            assert draw["seed"] == [0, draw["draw"]]
            assert list(draw["ids"]) == CLASSES  # every class, in label order, by name
            assert all(len(taken) == entry["shots"] for taken in draw["ids"].values())
            # The draw function's own rows, by class ...
            rows = draw_shots(y.numpy(), fit, entry["shots"], draw["draw"], seed=0)
            assert [ids[r] for r in rows] == sorted(
                (i for taken in draw["ids"].values() for i in taken), key=ids.index
            )
            for name, taken in draw["ids"].items():
                assert all(CLASSES[y[ids.index(i)]] == name for i in taken)
            # ... and fitting again on the rows those ids name gives the recorded top-1.
            again = torch.tensor([ids.index(i) for taken in draw["ids"].values() for i in taken])
            _, votes = _brute_force(x[again], y[again], test, 3, 0.07, 6)
            assert draw["k"]["3"]["top1"] == pytest.approx(_metrics(votes, test_labels)[0])
    assert len(entries) == 2 and entries[0]["draws"][0]["ids"] != entries[0]["draws"][1]["ids"]


def test_reports_json_and_plot_cover_every_method(stores, tmp_path):
    quick = {"lambdas": [1e-3, 1e-1], "refine": 0, "max_iter": 100, "progress": False}
    results = evaluate(
        stores["train"], "all", test=stores["test"], methods="linear,knn", ks=[5, 20], **quick
    )
    few = evaluate(stores["train"], "x", test=stores["test"], shots=[2], draws=2, **quick)
    linear, nn = results
    assert isinstance(linear, ProbeResult) and isinstance(nn, KnnResult)
    table = format_table([*results, *few]).splitlines()
    assert table[0].split() == ["layer", "dim", "method", "top-1", "top-5", "seconds"]
    assert [re.split(r"\s{2,}", line)[2] for line in table[1:5]] == [
        "linear",
        "k-NN k=5",
        "k-NN k=20",
        "linear 2-shot",
    ]
    assert "±" in table[4] and table[-1].startswith("top-1 and top-5 on the test store")
    report = format_result(nn)
    assert report.startswith("k-NN x [2, 5]: 240 train rows (the neighbours), 90 test rows")
    assert "k=20" in report and "exp(similarity / 0.07)" in report
    few_report = format_result(few[0])
    assert few_report.startswith("linear 2-shot x [2, 5]: 2 draws of 2 train rows per class")
    path = save_results([*results, *few], tmp_path / "all.json")
    document = json.loads(path.read_text())
    entries = document["results"]
    assert [e["method"] for e in entries] == ["linear", "knn", "linear"]
    assert entries[1]["metrics"]["20"]["top1"] == nn.metrics[20]["top1"]
    assert entries[2]["shots"] == 2 and len(entries[2]["draws"]) == 2
    assert "k-NN: cosine similarity" in document["protocol"]
    assert "few-shot" in document["protocol"] and document["options"]["methods"] == [
        "linear",
        "knn",
    ]
    png = plot_layers([*results, *few], tmp_path / "curve.png")
    with Image.open(png) as image:
        assert image.size == (720, 420)
        colours = {colour for _, colour in image.convert("RGB").getcolors(1 << 20)}
    assert {(31, 119, 180), (255, 127, 14), (44, 160, 44)} <= colours  # three method lines


def test_cli_runs_knn_and_few_shot(stores, tmp_path):
    out = tmp_path / "knn.json"
    args = ["probe", str(stores["train"]), "-l", "x", "--test", str(stores["test"])]
    quick = ["--lambdas", "1e-3,1e-1", "--no-progress"]
    result = runner.invoke(
        app, [*args, "--method", "linear,knn", "--k", "5,20", "-o", str(out), *quick]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["layer", "dim", "method"] and "k-NN k=20" in lines[3]
    assert [e["method"] for e in json.loads(out.read_text())["results"]] == ["linear", "knn"]
    result = runner.invoke(app, [*args, "--shots", "2", "--draws", "2", "--method", "knn", *quick])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("k-NN 2-shot x [2, 5]: 2 draws of 2 train rows per class")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "svm"], "methods[0] is 'svm'; choose one of: linear, knn"),
        (["--recipe", "simclr"], "recipe is 'simclr'; choose one of: dinov3, clip"),
        (["--normalize", "l3"], "normalize is 'l3'; choose one of: standardize, l2"),
        (["--k", "0,5"], "ks must be whole numbers >= 1 like 10,20, got '0,5'"),
        (["--draws", "3"], "draws counts few-shot draws; give shots too"),
        (["--shots", "a"], "shots must be whole numbers >= 1 like 1,5,10"),
        (["--temperature", "0"], "temperature must be a number > 0"),
        (["--recipe", "dinov3", "--lambdas", "1,2"], "lambdas and recipe dinov3 both set"),
        (["--recipe", "clip", "--trainer", "streaming"], "recipe clip fits in memory"),
        (["--shots", "100"], "class 0 has 32 rows to draw 100 shots from"),
    ],
)
def test_cli_bad_options_are_one_line_with_exit_2(stores, extra, message):
    result = runner.invoke(app, ["probe", str(stores["train"]), "-l", "x", *extra, "--no-progress"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr


def test_probe_layers_stays_linear(stores):
    with pytest.raises(ConfigError, match="featcache.probe.evaluate runs the methods"):
        from featcache.probe import probe_layers

        probe_layers(stores["train"], "x", methods="knn", progress=False)
    assert math.isclose(
        knn(stores["train"], "x", ks=[1], progress=False).top1,
        knn(stores["train"], "x", ks=[1], temperature=0.5, progress=False).top1,
    )  # with one neighbour the temperature changes nothing

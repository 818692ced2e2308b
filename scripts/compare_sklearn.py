"""The dinov3 probe recipe against scikit-learn's LogisticRegression on the same stores.

DINOv3's logistic-regression evaluation fits scikit-learn's ``LogisticRegression`` (L2,
L-BFGS, ``max_iter=1000``, ``tol=1e-12``, float64) on the raw features for 45 values of
``C`` log-spaced from 1e-6 to 1e5, chooses ``C`` by top-1 on 10% of each class of train
(the first best in increasing ``C``), refits on train + validation and scores the test
split. This script does exactly that with scikit-learn, beside ``featcache probe
--recipe dinov3`` (featcache's own L-BFGS on the same objective, ``lambda = 1 / (C N)``),
on the same validation rows, and prints the validation top-1 of every ``C``, the chosen
``C`` and the test top-1 of both. It exits with 1 when the test top-1 differ by more
than ``--tolerance`` points (0.5 by default).

    python scripts/compare_sklearn.py TRAIN.h5 TEST.h5 --layer layer3 [--seed 0]

The README's CIFAR-10 stores (``featcache extract`` of the ResNet-20 config in the
"Linear probes" section) are the stores it was run on.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import featcache  # noqa: F401  (before sklearn pulls in anything torchvision-related)
from featcache import FeatureStore
from featcache.probe import probe, recipe, stratified_split


def sklearn_dinov3(
    train: FeatureStore, test: FeatureStore, layer: str, seed: int
) -> tuple[list[float], float, float, float]:
    """The recipe with scikit-learn: validation top-1 per C, the chosen C, its
    validation top-1 and the refitted model's test top-1."""
    from sklearn.linear_model import LogisticRegression

    published = recipe("dinov3")
    assert published is not None
    x = train.read(layer).double().numpy().reshape(len(train), -1)
    y = np.asarray(train.labels)
    fit, val = stratified_split(y, published.val_fraction, seed)

    def model(c: float) -> LogisticRegression:
        return LogisticRegression(C=c, max_iter=published.max_iter, tol=1e-12)

    scores = []
    for c in published.values:
        estimator = model(c).fit(x[fit], y[fit])
        scores.append(float((estimator.predict(x[val]) == y[val]).mean()))
    best = int(np.argmax(scores))  # the first best in increasing C, as DINOv3 keeps it
    final = model(published.values[best]).fit(x, y)
    x_test = test.read(layer).double().numpy().reshape(len(test), -1)
    top1 = float((final.predict(x_test) == np.asarray(test.labels)).mean())
    return scores, published.values[best], scores[best], top1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("train")
    parser.add_argument("test")
    parser.add_argument("--layer", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=0.5, help="points of top-1")
    args = parser.parse_args()

    start = time.perf_counter()
    ours = probe(
        args.train, args.layer, test=args.test, recipe="dinov3", seed=args.seed, progress=False
    )
    ours_seconds = time.perf_counter() - start
    start = time.perf_counter()
    with FeatureStore(args.train) as train, FeatureStore(args.test) as test:
        scores, c, val_top1, top1 = sklearn_dinov3(train, test, args.layer, args.seed)
    sklearn_seconds = time.perf_counter() - start

    assert ours.test is not None
    ours_c = 1.0 / (ours.lam * ours.n_train)
    by_c = sorted(ours.sweep, key=lambda entry: entry["C"])
    print(f"layer {args.layer} {ours.shape}: {ours.n_train} fit, {ours.n_val} val, "
          f"{ours.n_test} test rows; recipe {recipe('dinov3').describe()}")  # type: ignore[union-attr]  # fmt: skip
    print(f"{'C':>9}  {'featcache val':>13}  {'sklearn val':>11}")
    for entry, score in zip(by_c, scores, strict=True):
        print(f"{entry['C']:>9.2e}  {100 * entry['val_top1']:>12.2f}%  {100 * score:>10.2f}%")
    difference = 100 * (ours.test["top1"] - top1)
    print(
        f"featcache: C {ours_c:.2e}, val top-1 {100 * ours.val['top1']:.2f}%, test top-1 "
        f"{100 * ours.test['top1']:.2f}% ({ours_seconds:.1f} s)\n"
        f"sklearn:   C {c:.2e}, val top-1 {100 * val_top1:.2f}%, test top-1 "
        f"{100 * top1:.2f}% ({sklearn_seconds:.1f} s)\n"
        f"test top-1 difference: {difference:+.2f} points (tolerance {args.tolerance})"
    )
    sys.exit(0 if abs(difference) <= args.tolerance else 1)


if __name__ == "__main__":
    main()

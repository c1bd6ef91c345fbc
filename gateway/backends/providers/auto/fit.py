"""Fit the auto classifier on the train split only: `python -m gateway.backends.providers.auto.fit`.

Multinomial logistic regression with L2, fit by full-batch gradient descent in numpy on
standardised features; the L2 strength is chosen by 5-fold cross-validation inside the train
split (the test split is never read here). Deterministic: the same data gives the same
weights.json byte for byte. Prints the cross-validated and train accuracies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from gateway.backends.providers.auto.classifier import LABELS, WEIGHTS, Weights, dump_weights
from gateway.backends.providers.auto.dataset import DATA_DIR, digest, load
from gateway.backends.providers.auto.features import FEATURE_NAMES, features

L2_GRID = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)
STEPS = 3000
LR = 0.5


def _fit(x: np.ndarray, y: np.ndarray, l2: float) -> tuple[np.ndarray, np.ndarray]:
    n, d = x.shape
    k = len(LABELS)
    w = np.zeros((k, d))
    b = np.zeros(k)
    onehot = np.eye(k)[y]
    for _ in range(STEPS):
        logits = x @ w.T + b
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / n
        w -= LR * (g.T @ x + l2 * w)
        b -= LR * g.sum(axis=0)
    return w, b


def _accuracy(x: np.ndarray, y: np.ndarray, w: np.ndarray, b: np.ndarray) -> float:
    return float(((x @ w.T + b).argmax(axis=1) == y).mean())


def _standardise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale < 1e-9] = 1.0
    return mean, scale


def fit(data_dir: Path = DATA_DIR, out: Path = WEIGHTS, folds: int = 5) -> Weights:
    train = [r for r in load(data_dir) if r["split"] == "train"]
    x = np.array([features(r["messages"]) for r in train], dtype=np.float64)
    y = np.array([LABELS.index(r["label"]) for r in train])
    fold = np.arange(len(train)) % folds
    cv: dict[float, float] = {}
    for l2 in L2_GRID:
        accs = []
        for f in range(folds):
            tr, va = fold != f, fold == f
            mean, scale = _standardise(x[tr])
            w, b = _fit((x[tr] - mean) / scale, y[tr], l2)
            accs.append(_accuracy((x[va] - mean) / scale, y[va], w, b))
        cv[l2] = float(np.mean(accs))
        print(f"  l2={l2:<6} cross-validated accuracy {cv[l2]:.3f}", file=sys.stderr)
    best = max(L2_GRID, key=lambda v: (round(cv[v], 6), v))  # ties: the stronger regulariser
    mean, scale = _standardise(x)
    w, b = _fit((x - mean) / scale, y, best)
    r6 = lambda a: tuple(round(float(v), 6) for v in a)  # noqa: E731
    weights = Weights(
        features=FEATURE_NAMES,
        labels=LABELS,
        mean=r6(mean),
        scale=r6(scale),
        coef=tuple(r6(row) for row in w),
        intercept=r6(b),
        fit={
            "l2": best,
            "cv_accuracy": round(cv[best], 4),
            "train_accuracy": round(_accuracy((x - mean) / scale, y, w, b), 4),
            "n_train": len(train),
            "steps": STEPS,
            "data_sha256": digest(data_dir),
        },
    )
    dump_weights(weights, out)
    return weights


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m gateway.backends.providers.auto.fit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--data", type=Path, default=DATA_DIR, help="directory of *.jsonl (default: %(default)s)"
    )
    ap.add_argument(
        "--out", type=Path, default=WEIGHTS, help="weights file to write (default: %(default)s)"
    )
    a = ap.parse_args(argv)
    w = fit(a.data, a.out)
    print(
        f"wrote {a.out}: l2={w.fit['l2']} cv_accuracy={w.fit['cv_accuracy']} "
        f"train_accuracy={w.fit['train_accuracy']} n_train={w.fit['n_train']}"
    )


if __name__ == "__main__":
    main()

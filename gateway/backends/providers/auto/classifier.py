"""The `model: "auto"` complexity classifier: standardised features → multinomial logistic
regression → simple | medium | hard, with class probabilities.

Prediction is pure Python over ~20 features (no numpy, no torch): a request costs about
0.1 ms, features included. The weights live in weights.json next to this file, written by
`python -m gateway.backends.providers.auto.fit` from the train split of data/router_eval only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from gateway.backends.providers.auto.features import FEATURE_NAMES, features

WEIGHTS = Path(__file__).with_name("weights.json")
LABELS = ("simple", "medium", "hard")


class Weights(msgspec.Struct, frozen=True, kw_only=True):
    features: tuple[str, ...]
    labels: tuple[str, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    coef: tuple[tuple[float, ...], ...]  # one row per label
    intercept: tuple[float, ...]
    #: how they were fit (L2 strength, cross-validated accuracy, data hash...)
    fit: dict[str, Any] = {}


class Prediction(msgspec.Struct, frozen=True, kw_only=True):
    label: str
    probs: dict[str, float]


class Classifier:
    def __init__(self, weights: Weights) -> None:
        if tuple(weights.features) != FEATURE_NAMES:
            raise ValueError(
                "weights.json was fit with other features; run python -m "
                "gateway.backends.providers.auto.fit"
            )
        self.weights = weights

    @classmethod
    def load(cls, path: Path = WEIGHTS) -> Classifier:
        return cls(msgspec.json.decode(path.read_bytes(), type=Weights))

    def predict_features(self, x: Sequence[float]) -> Prediction:
        w = self.weights
        z = [(v - m) / s for v, m, s in zip(x, w.mean, w.scale, strict=True)]
        logits = [
            b + sum(c * v for c, v in zip(row, z, strict=True))
            for row, b in zip(w.coef, w.intercept, strict=True)
        ]
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        total = sum(exps)
        probs = {label: e / total for label, e in zip(w.labels, exps, strict=True)}
        return Prediction(label=max(probs, key=probs.__getitem__), probs=probs)

    def predict(self, messages: Sequence[Mapping[str, Any]]) -> Prediction:
        return self.predict_features(features(messages))


def dump_weights(w: Weights, path: Path = WEIGHTS) -> None:
    path.write_text(json.dumps(msgspec.to_builtins(w), indent=1) + "\n")

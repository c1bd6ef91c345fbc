"""Fitting a node kind's step-time model to its samples (what `duet bench profile` runs); the
profile's schema itself is protocol/profile.py, re-exported here for the simulator's callers.

The fit is a non-negative least-squares fit weighted by 1/y (relative error), so extrapolation
never predicts a negative step and a 2 ms step counts as much as a 200 ms one.
"""

from __future__ import annotations

import numpy as np

from engine.step_model import nnls
from protocol.profile import (
    CoRun,
    CoRunShape,
    NodeKind,
    Overheads,
    Profile,
    Provenance,
    Source,
    StepFeatures,
    StepModel,
    StepSample,
    Transport,
    load,
    save,
)

__all__ = [
    "FEATURES",
    "CoRun",
    "CoRunShape",
    "NodeKind",
    "Overheads",
    "Profile",
    "Provenance",
    "Source",
    "StepFeatures",
    "StepModel",
    "StepSample",
    "Transport",
    "fit",
    "load",
    "save",
]

FEATURES = ("intercept", "prefill", "decode", "context", "attention", "cached_attention")


# -- fitting ----------------------------------------------------------------------------------
def _matrix(samples: list[StepSample]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array(
        [
            [1.0, s.prefill_tokens, s.decode_seqs, s.context_tokens, s.attention, _cached(s)]
            for s in samples
        ]
    )
    y = np.array([s.seconds for s in samples])
    return x, y


def _cached(s: StepSample) -> int:
    """Σ n·start of the sample; for samples recorded before it was, attention − prefill² (exact for
    one chunk; with several it is a lower bound, and the recorded value is never below it)."""
    return max(s.cached_attention, s.attention - s.prefill_tokens**2, 0)


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients ≥ 0, weighted by 1/y: the fit minimises *relative* error
    (a 2 ms step counts as much as a 200 ms one). The engine's online model (`--itl-target-ms`)
    fits the same form with the same solver."""
    return nnls(x, y, 1.0 / np.maximum(y, 1e-9))


def _ape(coef: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.abs(x @ coef - y) / np.maximum(y, 1e-9)


def fit(samples: list[StepSample], provenance: Provenance = Provenance.MEASURED) -> StepModel:
    """Fit the step model; the error on every 5th sample held out is reported beside the
    in-sample error, so over-fitting shows."""
    if len(samples) < len(FEATURES):
        raise ValueError(f"{len(samples)} samples cannot fit {len(FEATURES)} coefficients")
    x, y = _matrix(samples)
    hold = np.arange(len(samples)) % 5 == 4
    holdout = None
    if hold.sum() >= 2 and (~hold).sum() >= len(FEATURES):
        c = _nnls(x[~hold], y[~hold])
        holdout = float(_ape(c, x[hold], y[hold]).mean())
    coef = _nnls(x, y)
    ape = _ape(coef, x, y)
    return StepModel(
        intercept_s=float(coef[0]),
        prefill_s=float(coef[1]),
        decode_s=float(coef[2]),
        context_s=float(coef[3]),
        attention_s=float(coef[4]),
        cached_attention_s=float(coef[5]),
        provenance=provenance,
        fit_mape=float(ape.mean()),
        fit_max_ape=float(ape.max()),
        holdout_mape=holdout,
        num_samples=len(samples),
        max_prefill_tokens=max(s.prefill_tokens for s in samples),
        max_decode_seqs=max(s.decode_seqs for s in samples),
        max_context_tokens=max(s.context_tokens for s in samples),
    )

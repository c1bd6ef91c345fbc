"""A node kind's profile: what `duet bench profile` measures (or a published source gives) and
what the simulator and the autoscaler read.

A profile is one JSON file: the node kind (model, dtype/quantization, device, engine, KV
geometry, batch limits), the step-time samples, the fitted step-time model with its own fit
error, the KV transport's bandwidth and latency, per-request overheads, and `sources`: every
figure carried over from a publication, with where it comes from. `provenance` on the step
model and on the transport says whether the numbers were *measured* on a node, *fitted* to
published points, or *modelled* (a roofline form).

Step-time model (linear in five features of one engine step, seconds):
    t = intercept + prefill·P + decode·D + context·C + attention·A
P = prompt tokens computed in the step, D = sequences that sample a generated token, C = the
total context (tokens in the KV) of every sequence in the step, A = Σ over prefill chunks of
n·(start + n) (the quadratic part of prefill attention). Coefficients are kept ≥ 0 (a
non-negative least-squares fit), so extrapolation never predicts a negative step.
"""

from __future__ import annotations

import enum
from pathlib import Path

import msgspec
import numpy as np


class Provenance(enum.StrEnum):
    MEASURED = "measured"  # timed on a real node by `duet bench profile`
    FITTED = "fitted"  # a model fitted to published points
    MODELLED = "modelled"  # a form (roofline) with assumed constants


class Source(msgspec.Struct, frozen=True, kw_only=True):
    """One figure carried over from a publication."""

    what: str
    value: str
    url: str
    note: str = ""


class StepSample(msgspec.Struct, frozen=True, array_like=True):
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    attention: int  # Σ n·(start+n) over prefill chunks
    seconds: float
    #: CPU time of the step (every thread of the process): wall / cpu shows contention
    cpu_seconds: float = 0.0


class StepFeatures(msgspec.Struct, frozen=True, array_like=True):
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    attention: int


FEATURES = ("intercept", "prefill", "decode", "context", "attention")


class StepModel(msgspec.Struct, frozen=True, kw_only=True):
    intercept_s: float
    prefill_s: float  # per prompt token computed
    decode_s: float  # per sequence sampling a token
    context_s: float  # per context token of every sequence in the step
    attention_s: float  # per unit of Σ n·(start+n)
    provenance: Provenance
    #: mean / max absolute percentage error of the model on its own samples (None: no samples)
    fit_mape: float | None = None
    fit_max_ape: float | None = None
    #: the same on samples held out of the fit (every 5th one)
    holdout_mape: float | None = None
    num_samples: int = 0
    #: the ranges the samples covered: beyond them the model extrapolates
    max_prefill_tokens: int = 0
    max_decode_seqs: int = 0
    max_context_tokens: int = 0

    def seconds(self, f: StepFeatures) -> float:
        return (self.intercept_s + self.prefill_s * f.prefill_tokens + self.decode_s * f.decode_seqs
                + self.context_s * f.context_tokens + self.attention_s * f.attention)  # fmt: skip

    def scaled(self, factor: float) -> StepModel:
        """Every coefficient × factor (a node kind that is uniformly faster or slower)."""
        return msgspec.structs.replace(
            self, intercept_s=self.intercept_s * factor, prefill_s=self.prefill_s * factor,
            decode_s=self.decode_s * factor, context_s=self.context_s * factor,
            attention_s=self.attention_s * factor)  # fmt: skip


class Transport(msgspec.Struct, frozen=True, kw_only=True):
    backend: str
    bandwidth_bytes_per_s: float
    latency_s: float
    provenance: Provenance
    #: the transfer sizes the measurement covered
    sizes_bytes: list[int] = []

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


class Overheads(msgspec.Struct, frozen=True, kw_only=True):
    """Time a request spends outside the forward pass, per request (seconds)."""

    #: gateway in + route + the leg's HTTP up to the node's queue (client → first step)
    request_s: float = 0.0
    #: a disaggregated request's extra hop (P's answer back to the gateway and the D leg's start)
    pd_hop_s: float = 0.0
    #: last token → client (the stream's relay)
    stream_s: float = 0.0
    provenance: Provenance = Provenance.MODELLED


class NodeKind(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    model: str
    dtype: str
    quantization: str | None = None
    device: str  # "cpu (N threads)" or "2x H100 SXM (TP2)"
    engine: str = "native"
    gpus: int = 0
    block_size: int = 16
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class Profile(msgspec.Struct, kw_only=True):
    version: int = 1
    kind: NodeKind
    step: StepModel
    transport: Transport
    overheads: Overheads = Overheads()
    samples: list[StepSample] = []
    sources: list[Source] = []
    notes: list[str] = []
    measured_at: str | None = None
    host: str | None = None
    #: CPU node kinds on a shared machine: the median wall × threads / CPU of the profiled steps,
    #: which the step model includes (None: the node had its CPUs, e.g. a GPU kind)
    contention: float | None = None

    def at_contention(self, factor: float) -> Profile:
        """This profile on a machine whose contention is `factor` instead of the profile's own
        (step times and per-request overheads scale with it; GPU kinds are left alone)."""
        if self.contention is None or not factor > 0:
            return self
        k = factor / self.contention
        o = self.overheads
        return msgspec.structs.replace(
            self, step=self.step.scaled(k), contention=factor,
            overheads=msgspec.structs.replace(o, request_s=o.request_s * k, pd_hop_s=o.pd_hop_s * k,
                                              stream_s=o.stream_s * k))  # fmt: skip

    def kv_blocks(self) -> int:
        return self.kind.kv_capacity_tokens // self.kind.block_size


_ENC = msgspec.json.Encoder()


def save(profile: Profile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(_ENC.encode(profile), indent=1) + b"\n")


def load(path: Path) -> Profile:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Profile)
    except FileNotFoundError:
        raise ValueError(f"no profile at {path}") from None
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: not a duet profile ({e})") from None


# -- fitting ----------------------------------------------------------------------------------
def _matrix(samples: list[StepSample]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([[1.0, s.prefill_tokens, s.decode_seqs, s.context_tokens, s.attention] for s in samples])
    y = np.array([s.seconds for s in samples])
    return x, y


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients ≥ 0, weighted by 1/y (so the fit minimises *relative*
    error: a 2 ms step counts as much as a 200 ms one). Active set: drop the most negative
    coefficient and refit until none is negative (5 features: at most 5 refits)."""
    w = 1.0 / np.maximum(y, 1e-9)
    xw, yw = x * w[:, None], y * w
    active = list(range(x.shape[1]))
    # a column that is all zero (e.g. no prefill samples) cannot be fitted: leave it at 0
    active = [j for j in active if np.any(x[:, j])]
    while True:
        coef = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        coef[active] = sol
        neg = [j for j in active if coef[j] < 0]
        if not neg:
            return coef
        active.remove(min(neg, key=lambda j: coef[j]))


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
        intercept_s=float(coef[0]), prefill_s=float(coef[1]), decode_s=float(coef[2]),
        context_s=float(coef[3]), attention_s=float(coef[4]), provenance=provenance,
        fit_mape=float(ape.mean()), fit_max_ape=float(ape.max()), holdout_mape=holdout,
        num_samples=len(samples), max_prefill_tokens=max(s.prefill_tokens for s in samples),
        max_decode_seqs=max(s.decode_seqs for s in samples),
        max_context_tokens=max(s.context_tokens for s in samples),
    )  # fmt: skip

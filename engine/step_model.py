"""Online step-time model: how long the next engine step will take, from what is in it, refitted
while the engine runs. The scheduler reads it to size prefill chunks for an ITL target
(`EngineConfig.itl_target_ms`): every decoding request waits for the whole step, so a step that
carries a big prefill chunk is an inter-token gap for all of them.

Form (the one `duet bench profile` fits offline for the simulator, sim/profile.py):
    t = intercept + prefill·P + decode·D + context·C + attention·A
P = prompt tokens computed in the step, D = sequences that sample a generated token, C = the
total context (tokens in the KV) of every sequence in the step, A = Σ over prefill chunks of
n·(start + n) (the quadratic part of prefill attention). `shape_of` reads these features off a
step's chunks exactly as sim/node.py's `features` does.

Fit: the last `window` steps (wall time of `EngineCore.step`, so whatever else runs on the
machine is in the figures) plus a prior written as a few pseudo-steps at typical shapes, by
least squares weighted by 1/t (relative error: a 5 ms step counts as much as a 500 ms one, and
one stalled step weighs little) with every coefficient kept ≥ 0 (so a prediction never falls
as a step grows). The prior only decides the directions the recent steps do not cover — e.g.
the prefill cost after a run of pure decode steps — and real steps outweigh it wherever they
vary. `margin` is a high quantile of measured/predicted over the window: the scheduler plans
against target / margin, so the *tail* of the step times, not their mean, meets the target.

Invariants: predictions are monotone in every feature; `max_prefill` is the largest P whose
predicted step (times the margin) stays ≤ the target, 0 when even no prefill would not.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine.scheduler import ScheduledChunk


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0
    attention: int = 0  # Σ n·(start+n) over prefill chunks
    #: Σ n·start over prefill chunks: the pairs that read earlier chunks' KV from the paged pool
    #: (the offline profile's sixth feature; this online model keeps the five above)
    cached_attention: int = 0

    def row(self) -> tuple[float, float, float, float, float]:
        return (1.0, self.prefill_tokens, self.decode_seqs, self.context_tokens, self.attention)


def shape_of(chunks: Iterable[ScheduledChunk]) -> StepShape:
    prefill = decode = ctx = attn = cached = 0
    for c in chunks:
        end = c.start + c.num_tokens
        ctx += end
        if c.start < c.req.num_prompt_tokens:  # prompt work (a chunk, or D's last-token recompute)
            prefill += c.num_tokens
            attn += c.num_tokens * end
            cached += c.num_tokens * c.start
        else:
            decode += 1
    return StepShape(prefill, decode, ctx, attn, cached)


@dataclass(frozen=True)
class Coefficients:
    intercept_s: float
    prefill_s: float  # per prompt token computed
    decode_s: float  # per sequence sampling a token
    context_s: float  # per context token of every sequence in the step
    attention_s: float  # per unit of Σ n·(start+n)

    def seconds(self, s: StepShape) -> float:
        return (
            self.intercept_s
            + self.prefill_s * s.prefill_tokens
            + self.decode_s * s.decode_seqs
            + self.context_s * s.context_tokens
            + self.attention_s * s.attention
        )


#: warm start: a ~100M-parameter model on one CPU core (SmolLM2-135M bf16 on this project's CI
#: class of machine, data/profiles/ scaled to an unloaded core). Slower than most nodes, so the
#: first chunks err small; the fit moves off it within a few steps that carry prefill.
DEFAULT_PRIOR = Coefficients(
    intercept_s=0.03, prefill_s=5e-4, decode_s=5e-4, context_s=5e-6, attention_s=1e-6
)

#: the prior's pseudo-steps: decode batches at a few contexts, prefill chunks at a few starts, mixed
_PRIOR_SHAPES = (
    StepShape(0, 1, 128),
    StepShape(0, 8, 8 * 512),
    StepShape(0, 32, 32 * 1024),
    StepShape(64, 0, 64, 64 * 64),
    StepShape(512, 0, 512, 512 * 512),
    StepShape(256, 0, 2048, 256 * 2048),
    StepShape(128, 8, 8 * 512 + 1024, 128 * 1024),
)


class OnlineStepModel:
    def __init__(
        self,
        prior: Coefficients = DEFAULT_PRIOR,
        *,
        window: int = 256,
        refit_every: int = 8,
        prior_weight: float = 0.1,
        margin_quantile: float = 0.9,
        max_margin: float = 2.0,
    ) -> None:
        if window < 8 or refit_every < 1:
            raise ValueError("window must be ≥ 8 steps and refit_every ≥ 1")
        self.prior = prior
        self.coef = prior
        self.margin = 1.0
        self.num_observed = 0
        self._rows: deque[tuple[float, ...]] = deque(maxlen=window)
        self._secs: deque[float] = deque(maxlen=window)
        self._refit_every = refit_every
        self._prior_x = np.array([s.row() for s in _PRIOR_SHAPES])
        self._prior_y = np.array([prior.seconds(s) for s in _PRIOR_SHAPES])
        self._prior_w = prior_weight
        self._q = margin_quantile
        self._max_margin = max_margin

    # -- learning --------------------------------------------------------------------------
    def observe(self, shape: StepShape, seconds: float) -> None:
        if not seconds > 0 or not math.isfinite(seconds):
            return
        self._rows.append(shape.row())
        self._secs.append(seconds)
        self.num_observed += 1
        if self.num_observed % self._refit_every == 0:
            self.refit()

    def refit(self) -> None:
        if not self._rows:
            return
        x_real, y_real = np.array(self._rows), np.array(self._secs)
        x = np.vstack([x_real, self._prior_x])
        y = np.concatenate([y_real, self._prior_y])
        w = np.concatenate([1.0 / y_real, self._prior_w / self._prior_y])
        c = nnls(x, y, w)
        self.coef = Coefficients(*map(float, c))
        pred = np.maximum(x_real @ c, 1e-9)
        ratio = float(np.quantile(y_real / pred, self._q)) if len(y_real) >= 16 else 1.0
        self.margin = min(max(ratio, 1.0), self._max_margin)

    # -- planning --------------------------------------------------------------------------
    def predict(self, shape: StepShape) -> float:
        return self.coef.seconds(shape)

    def max_prefill(
        self, decode_seqs: int, decode_context: int, start: int, target_s: float, cap: int
    ) -> int:
        """The most prompt tokens (≤ cap) one chunk starting at position `start` may add to a step
        that decodes `decode_seqs` sequences of `decode_context` total context, with the
        predicted step × margin ≤ target_s. Solves a·P² + b·P + base ≤ budget (a, b ≥ 0)."""
        k = self.coef
        budget = target_s / self.margin
        base = k.intercept_s + k.decode_s * decode_seqs + k.context_s * (decode_context + start)
        room = budget - base
        if room <= 0:
            return 0
        a, b = k.attention_s, k.prefill_s + k.context_s + k.attention_s * start
        if a > 0:
            p = (-b + math.sqrt(b * b + 4 * a * room)) / (2 * a)
        elif b > 0:
            p = room / b
        else:
            return cap
        return max(0, min(cap, int(p)))


def nnls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares (the simulator's offline fit, sim/profile.py, uses it too) with
    coefficients ≥ 0 (active set: drop the most negative one and refit until none is; 5 features, at
    most 5 refits). Columns are scaled to unit size first: the attention feature is ~10⁶ times the
    intercept's."""
    xw, yw = x * w[:, None], y * w
    scale = np.abs(xw).max(axis=0)
    active = [j for j in range(x.shape[1]) if scale[j] > 0]
    xs = xw / np.where(scale > 0, scale, 1.0)
    while True:
        coef = np.zeros(x.shape[1])
        if not active:
            return coef
        sol, *_ = np.linalg.lstsq(xs[:, active], yw, rcond=None)
        coef[active] = sol / scale[active]
        neg = [j for j in active if coef[j] < 0]
        if not neg:
            return coef
        active.remove(min(neg, key=lambda j: coef[j]))

"""Load mode's predictor: what a pool's nodes would show with its load spread over n replicas.

From the totals of a pool's warm nodes (planner/pools.py) and the node kind's step cost:
- TTFT: a request queued behind q prompt tokens waits q / chunk steps and then its own, each step
  costing intercept + prefill·chunk + the decode batch riding on it;
- ITL: one decode step of r sequences with their context;
- KV use and admission waiting: the totals over n.

Scale-in asks the same question at n − 1 (Dynamo PR #9294: the survivors carry the leaver's
load). Queues alone cannot answer it near saturation: a prefill pool that keeps up shows empty
queues at any utilisation, so for prefill pools the nodes' busy fractions (load frames' `busy`,
node/busy_window.py) are spread over n − 1 as well, and each survivor must stay under
(1 − margin) × `busy_high` (`too_busy`). The prediction is a model, not a measurement: its inputs
are logged with every decision.
Where the nodes measured the figure itself (their load frames' TTFT / ITL P90 over a recent
window, with enough samples), the planner takes the larger of the two (`with_measured`): a step
model fitted on another machine, or a load the model does not see (long prompts, preemptions),
must not hide a pool that misses its SLO. At n − 1 the measured figure at n is a floor: fewer
nodes never make the survivors faster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.config import PlannerConfig, StepCost, TierSLO
from planner.pools import Measured, PoolLoad


@dataclass(frozen=True)
class Prediction:
    replicas: int
    ttft_s: float
    itl_s: float
    kv_usage: float
    waiting: float
    #: each node's busy fraction (None: the pool's nodes do not all report it)
    busy: float | None = None

    def as_dict(self) -> dict[str, float]:
        out = {
            "n": self.replicas,
            "ttft_s": round(self.ttft_s, 4),
            "itl_s": round(self.itl_s, 4),
            "kv": round(self.kv_usage, 3),
            "waiting": round(self.waiting, 2),
        }
        if self.busy is not None:
            out["busy"] = round(self.busy, 3)
        return out


def _step(c: StepCost, prefill_tokens: float, seqs: float, context: float) -> float:
    return (
        c.intercept_s
        + c.prefill_s * prefill_tokens
        + c.decode_s * seqs
        + c.context_s * seqs * context
    )


def predict(load: PoolLoad, n: int, cfg: PlannerConfig) -> Prediction:
    """The per-node figures of `load` spread evenly over `n` ≥ 1 replicas."""
    n = max(n, 1)
    q = load.queued_prefill_tokens / n
    r = load.running / n
    w = load.waiting / n
    chunk = cfg.chunk_tokens
    decoding = r if load.key.role != "prefill" else 0.0
    ttft = (1 + q / chunk) * _step(cfg.step, min(chunk, q + 1), decoding, cfg.context_tokens)
    itl = _step(cfg.step, 0, r, cfg.context_tokens) if load.key.role != "prefill" else 0.0
    return Prediction(
        replicas=n,
        ttft_s=ttft,
        itl_s=itl,
        kv_usage=load.kv_usage / n,
        waiting=w,
        busy=load.busy / n if load.busy is not None else None,
    )


def with_measured(
    p: Prediction, m: Measured, role: str, min_samples: int
) -> tuple[Prediction, list[str]]:
    """`p` with TTFT (prefill, colocated) and ITL (decode, colocated) raised to the measured P90
    where it has ≥ `min_samples` samples; and the figures the measurement raised."""
    ttft, itl, raised = p.ttft_s, p.itl_s, []
    if role in ("prefill", "both") and m.ttft_samples >= min_samples and m.ttft_p90_s > ttft:
        ttft = m.ttft_p90_s
        raised.append("ttft")
    if role in ("decode", "both") and m.itl_samples >= min_samples and m.itl_p90_s > itl:
        itl = m.itl_p90_s
        raised.append("itl")
    return replace(p, ttft_s=ttft, itl_s=itl), raised


def counted(m: Measured, role: str, min_samples: int) -> list[str]:
    """The measured figures of a `role` pool with enough samples to count."""
    out = []
    if role in ("prefill", "both") and m.ttft_samples >= min_samples:
        out.append("ttft")
    if role in ("decode", "both") and m.itl_samples >= min_samples:
        out.append("itl")
    return out


def violations(
    p: Prediction, role: str, slo: TierSLO, cfg: PlannerConfig, scale: float = 1.0
) -> list[str]:
    """The bounds `p` exceeds, each bound × `scale` (1: the SLO; 1 − margin: the scale-in test).
    Named after the planner's reasons (planner/decide.py Reason)."""
    out = []
    if role in ("prefill", "both") and p.ttft_s > slo.ttft_s * scale:
        out.append("ttft")
    if role in ("decode", "both") and p.itl_s > slo.itl_s * scale:
        out.append("itl")
    if p.kv_usage > cfg.kv_high * scale:
        out.append("kv_cache")
    if role in ("decode", "both") and p.waiting > cfg.waiting_high * scale:
        out.append("queue")
    return out


def too_busy(p: Prediction, role: str, cfg: PlannerConfig, fresh: bool) -> bool:
    """Scale-in test of a prefill pool at n − 1 (`p`): a survivor would be busier than
    (1 − margin) × busy_high, or the busy fractions are not `fresh` (their window began before
    the pool's last step: right after a scale-in they still average in the time when the
    leaver carried its share). Decode and colocated nodes step whenever a sequence decodes, so
    their busy fraction says nothing of spare capacity (batching absorbs more); pools whose
    nodes do not report it are judged by their queues alone, as before."""
    if role != "prefill" or p.busy is None:
        return False
    return not fresh or p.busy > cfg.busy_high * (1 - cfg.margin)

"""Verification of a draft against the target model's logits: which draft tokens stand, and the
token that follows them.

Rows: the target's logits at the draft's positions, k + 1 rows for a k-token draft (row i scores
the token after draft[:i]). Greedy: the longest prefix of the draft that equals the row-wise
argmax, then the argmax after it — exactly the tokens non-speculative greedy decoding yields.
Sampled: rejection sampling. Draft token d at row i, drawn from the draft's distribution q_i,
stands with probability min(1, p_i(d) / q_i(d)); on a rejection the token comes from the residual
max(p_i - q_i, 0), renormalized; when every draft token stands, the bonus token comes from p_k.
An n-gram draft (or a greedy model draft) is a point mass, q_i(d) = 1: d stands with probability
p_i(d) and the residual is p_i with d removed. Each emitted token is then distributed exactly as
non-speculative sampling's (Leviathan et al. 2023), with p after temperature, top-k and top-p
as the Sampler applies them, drawn with the request's own generator.

Invariant: 1 <= len(emitted) <= len(draft) + 1 and emitted[:-1] == draft[:len(emitted) - 1].
"""

from __future__ import annotations

import torch

from engine.sampler import processed_probs
from protocol.sampling import SamplingParams


def verify_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """targets: the argmax of each of the len(draft) + 1 rows."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return [*draft[:a], targets[a]]


def verify_sampled(
    draft: list[int],
    rows: torch.Tensor,
    params: SamplingParams,
    gen: torch.Generator,
    q: torch.Tensor | None = None,
) -> list[int]:
    """q: [len(draft), V] the draft's distributions over the target's vocabulary (None: point
    masses on the draft tokens)."""
    probs = processed_probs(rows, [params] * rows.shape[0])
    out: list[int] = []
    for i, d in enumerate(draft):
        p = probs[i]
        u = torch.rand((), generator=gen).item()
        qd = 1.0 if q is None else q[i, d].item()
        if u * qd < p[d].item():
            out.append(d)
            continue
        if q is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - q[i]).clamp_(min=0.0)
        if (
            residual.sum() <= 0
        ):  # p <= q everywhere means p == q: then u * q(d) < p(d) always, unreachable
            out.append(d)
            return out
        out.append(int(torch.multinomial(residual, 1, generator=gen).item()))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=gen).item()))
    return out

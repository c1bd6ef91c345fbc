"""Penalties and biases on a step's logits, before the guide's mask and sampling.

Definitions (each is exact against a few lines of plain torch in tests/engine/test_penalties.py):
- `logit_bias` (OpenAI): logit[t] += bias[t];
- `repetition_penalty` (vLLM): for every token t seen in prompt + output, logit[t] /= p when
  it is positive, *= p otherwise;
- `frequency_penalty`, `presence_penalty` (OpenAI): with c[t] the count of t in the output so
  far, logit[t] -= c[t] * frequency + (c[t] > 0) * presence.
They apply in vLLM's order (bias, then repetition, then frequency/presence), to greedy and sampled
rows alike; `min_p` needs the temperature and lives in the sampler (engine/sampler.py).

"The output so far" is what the request generated here plus, on a migrated leg, the `resume`
tokens at the end of its prompt (protocol/resume.py): a decode node penalises the tokens the
client already has as the node that sampled them did.

Invariant: rows whose params ask for nothing are untouched, and `logits` itself is never
written (the forward pass's tensor may be read again for logprobs): a changed copy is returned.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.request import Request


def output_so_far(req: Request) -> list[int]:
    """The request's output tokens, a migrated leg's already-streamed ones first."""
    r = req.params.resume
    done = (
        req.prompt_token_ids[len(req.prompt_token_ids) - r.output_tokens :] if r is not None else []
    )
    return done + req.output_token_ids


def penalize_row(x: np.ndarray, req: Request) -> None:
    """Apply `req`'s bias and penalties to its row `x` ([V] float32) in place. Only the ids
    involved are touched (numpy, single-threaded: no whole-vocabulary pass per row)."""
    p = req.params
    if p.logit_bias:  # dict keys: each id once
        x[np.fromiter(p.logit_bias, dtype=np.int64)] += np.fromiter(
            p.logit_bias.values(), dtype=np.float32
        )
    out = output_so_far(req)
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(req.prompt_token_ids + out, dtype=np.int64))
        v = x[seen]
        x[seen] = np.where(
            v > 0, v / np.float32(p.repetition_penalty), v * np.float32(p.repetition_penalty)
        )
    if (p.frequency_penalty or p.presence_penalty) and out:
        ids, counts = np.unique(np.asarray(out, dtype=np.int64), return_counts=True)
        x[ids] -= (counts * p.frequency_penalty + p.presence_penalty).astype(np.float32)


def penalize(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """`logits` [S, V] with row r penalised for `reqs[r]`: a float32 CPU copy when any row
    asks, else `logits` itself."""
    rows = [r for r, req in enumerate(reqs) if req.params.penalized]
    if not rows:
        return logits
    x = logits.detach().float().cpu().numpy().copy()
    for r in rows:
        penalize_row(x[r], reqs[r])
    return torch.from_numpy(x)

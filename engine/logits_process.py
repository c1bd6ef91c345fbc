"""Penalties and biases on a step's logits, before the guide's mask and sampling (issue #24).

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

import torch

from engine.request import Request


def output_so_far(req: Request) -> list[int]:
    """The request's output tokens, a migrated leg's already-streamed ones first."""
    r = req.params.resume
    done = req.prompt_token_ids[len(req.prompt_token_ids) - r.output_tokens :] if r is not None else []
    return done + req.output_token_ids


def penalize_row(x: torch.Tensor, req: Request) -> None:
    """Apply `req`'s bias and penalties to its row `x` ([V] float32) in place."""
    p = req.params
    vocab = x.shape[0]
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        x.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=x.dtype))
    out = output_so_far(req)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(req.prompt_token_ids + out, dtype=torch.long)] = True
        x.copy_(torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x))
    if (p.frequency_penalty or p.presence_penalty) and out:
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab)[:vocab].to(x.dtype)
        x -= counts * p.frequency_penalty + (counts > 0).to(x.dtype) * p.presence_penalty


def penalize(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """`logits` [S, V] with row r penalised for `reqs[r]`: a float32 copy when any row asks,
    else `logits` itself."""
    rows = [r for r, req in enumerate(reqs) if req.params.penalized]
    if not rows:
        return logits
    x = logits.float().clone()
    for r in rows:
        penalize_row(x[r], reqs[r])
    return x

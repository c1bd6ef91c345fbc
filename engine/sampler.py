"""Token selection from a step's logits: greedy, temperature, top-k, top-p, per-request seed.

Greedy rows take the argmax (the same token transformers' greedy search picks: the first
maximum), with the `argmax_rows` CPU kernel when available, on the logits as they come: fp32
from the model in every dtype (engine/logits_head.py), so a bf16 engine no longer ties tokens
whose logits differ below bf16's precision. Sampled rows are processed together in fp32 for
temperature, min-p (vLLM's), top-k and top-p, then
each draws with its own `torch.Generator` when it has a seed, so its tokens do not depend on
what else is batched. A migrated request (`params.resume`) first advances its generator by the
draws its already-streamed tokens took on the node that sampled them: `torch.multinomial` of one
sample draws one exponential per vocabulary entry whatever the probabilities, so K dummy draws
over the same vocabulary leave the generator where the first node's was.

Penalties, logit_bias and a guide's mask reach here already applied to the logits
(engine/logits_process.py, engine/guided.py). `token_logprobs` scores tokens under the raw
distribution (see there); it is used only for requests that ask for logprobs.

Invariant: the returned list has one token per input row, in row order. A row that cannot be
sampled (non-finite probabilities, a greedy row whose chosen logit is NaN or infinite, a
generator error) fails alone: `sample_rows` reports it in
its errors and every other row still gets its token.
"""

from __future__ import annotations

import torch

from engine.kernels import kernels_lib
from engine.sampling_params import SamplingParams
from protocol.logprobs import TokenLogprob


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        #: seeded migrated requests whose generator has not yet skipped the streamed tokens' draws
        self._skip: dict[str, int] = {}
        self._lib = kernels_lib()

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._skip.pop(request_id, None)

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        """The request's own generator (seeded requests), else the engine's."""
        return self._generator(request_id, params)

    def argmax(self, logits: torch.Tensor) -> list[int]:
        return self._argmax(logits)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default
        g = self._generators.get(request_id)
        if g is None:
            g = self._generators[request_id] = torch.Generator().manual_seed(params.seed)
            if params.resume is not None:
                self._skip[request_id] = params.resume.output_tokens
        return g

    def _advance(self, request_id: str, g: torch.Generator, vocab: int) -> None:
        skip = self._skip.pop(request_id, 0)
        if skip:
            ones = torch.ones(vocab)
            for _ in range(skip):
                torch.multinomial(ones, 1, generator=g)

    def sample(
        self,
        logits: torch.Tensor,  # [S, V] float32 or the model dtype
        rows: list[tuple[str, SamplingParams, bool]],  # (request id, params, eos allowed)
        eos_ids: list[frozenset[int]] | None = None,
    ) -> list[int]:
        """One token per row; raises if any row failed (offline use)."""
        out, errors = self.sample_rows(logits, rows, eos_ids)
        if errors:
            raise RuntimeError("; ".join(errors.values()))
        return out

    def sample_rows(
        self,
        logits: torch.Tensor,
        rows: list[tuple[str, SamplingParams, bool]],
        eos_ids: list[frozenset[int]] | None = None,
    ) -> tuple[list[int], dict[int, str]]:
        """One token per row, and {row: reason} for rows that could not be sampled (their
        token is -1)."""
        errors: dict[int, str] = {}
        logits = logits.cpu()
        if eos_ids is not None:
            masked = [r for r, (_, _, allowed) in enumerate(rows) if not allowed and eos_ids[r]]
            if (
                masked
            ):  # min_tokens not reached yet; a copy: the forward pass's logits are read-only
                logits = logits.clone()
            for r in masked:
                logits[r, list(eos_ids[r])] = float("-inf")
        out = self._argmax(logits)
        _check_greedy(logits, rows, out, errors)
        sampled = [r for r, (_, p, _) in enumerate(rows) if not p.greedy]
        if not sampled:
            return out, errors
        try:
            self._draw(logits, rows, sampled, out, errors)
        except Exception:  # the batch failed as a whole: find the row(s) at fault
            for r in sampled:
                try:
                    self._draw(logits, rows, [r], out, errors)
                except Exception as e:
                    errors[r], out[r] = f"sampling failed: {type(e).__name__}: {e}", -1
        return out, errors

    def _draw(
        self,
        logits: torch.Tensor,
        rows: list[tuple[str, SamplingParams, bool]],
        sampled: list[int],
        out: list[int],
        errors: dict[int, str],
    ) -> None:
        params = [rows[r][1] for r in sampled]
        probs = processed_probs(logits[sampled], params)
        finite = torch.isfinite(probs).all(dim=-1).tolist()
        for j, r in enumerate(sampled):
            if not finite[j]:
                errors[r], out[r] = "sampling failed: the probabilities are not finite", -1
                continue
            try:
                g = self._generator(rows[r][0], params[j])
                if params[j].seed is not None:
                    self._advance(rows[r][0], g, probs.shape[-1])
                out[r] = int(torch.multinomial(probs[j], 1, generator=g).item())
            except (RuntimeError, ValueError, OverflowError) as e:
                errors[r], out[r] = f"sampling failed: {e}", -1

    def _argmax(self, logits: torch.Tensor) -> list[int]:
        lib = self._lib
        if (
            lib is None
            or logits.dtype not in (torch.float32, torch.bfloat16)
            or logits.stride(1) != 1
        ):
            return logits.argmax(dim=-1).tolist()
        idx = torch.empty(logits.shape[0], dtype=torch.long)
        lib.argmax_rows(
            logits.data_ptr(),
            logits.stride(0),
            logits.shape[0],
            logits.shape[1],
            int(logits.dtype == torch.bfloat16),
            idx.data_ptr(),
        )
        return idx.tolist()


def _check_greedy(
    logits: torch.Tensor,
    rows: list[tuple[str, SamplingParams, bool]],
    out: list[int],
    errors: dict[int, str],
) -> None:
    """A greedy row whose chosen logit is NaN or infinite fails alone (its token is -1): an
    argmax over NaN picks no meaningful token, and one row must not hand it on."""
    greedy = [r for r, (_, p, _) in enumerate(rows) if p.greedy]
    if not greedy:
        return
    picked = logits[greedy, [out[r] for r in greedy]]
    for r, ok in zip(greedy, torch.isfinite(picked).tolist(), strict=True):
        if not ok:
            errors[r], out[r] = "sampling failed: the logits are not finite", -1


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Row r's sampling distribution: fp32 softmax after params[r]'s temperature, min-p, top-k,
    top-p (vLLM's order)."""
    x = logits.float() / torch.tensor([p.temperature for p in params]).unsqueeze(1)
    if any(p.min_p > 0 for p in params):
        x = apply_min_p(x, torch.tensor([p.min_p for p in params]))
    if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
        x = _top_k_top_p(x, params)
    return torch.softmax(x, dim=-1)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min-p: drop the tokens whose probability (after temperature) is below min_p[r]
    times the row's top probability (the top token always stays)."""
    probs = torch.softmax(x, dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return x.masked_fill(probs < floor, float("-inf"))


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int]
) -> list[TokenLogprob]:
    """Row r: the logprob of `token_ids[r]`, its rank and the `num_top[r]` most likely tokens,
    from the log-softmax of the raw logits in fp32 (the model's distribution before temperature,
    top-k, top-p and min_tokens' EOS mask: vLLM's default `logprobs_mode`, so a value does not
    change with how the token was chosen)."""
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = lp.gather(1, torch.tensor(token_ids, device=lp.device).unsqueeze(1))
    # vLLM's rank: the tokens at least as likely as the chosen one, itself included
    ranks = (lp >= chosen_t).sum(dim=-1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    k = min(max(num_top), lp.shape[-1])
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    vals, ids = top_v.tolist(), top_i.tolist()
    return [
        TokenLogprob(
            token_id=t,
            logprob=chosen[r],
            top=list(zip(ids[r][: num_top[r]], vals[r][: num_top[r]], strict=True)),
            rank=ranks[r],
        )
        for r, t in enumerate(token_ids)
    ]


def _top_k_top_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    sorted_x, idx = x.sort(dim=-1, descending=True)
    vocab = x.shape[-1]
    ks = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= ks.unsqueeze(1)
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    cum = probs.cumsum(dim=-1)
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
    # Keep a token while the mass before it is below top_p (so the top token always stays).
    drop |= (cum - probs) >= top_p
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, idx, sorted_x)

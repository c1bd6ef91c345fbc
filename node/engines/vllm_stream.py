"""VllmStream: one request's vLLM output collector seen as the node seam's `Delta` stream.

vLLM's DELTA RequestOutputs become `Delta`s: new token ids and text, logprobs in duet's records,
and on the finishing one vLLM's KV handoff params (typed) and the request's times. A request that
fails inside vLLM (an exception from its collector, or finish_reason "error") ends that stream
with an error delta; only EngineDeadError is the engine's death.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from node.engine_api import Delta, EngineDead
from node.engines.vllm_sampling import kv_params_from_vllm
from protocol.logprobs import TokenLogprob
from protocol.sampling import SamplingParams


def _record(tok: int, d: Any, n: int) -> TokenLogprob:
    """vLLM's {token id: Logprob} dict of one position (the chosen token plus the top n, vLLM's
    raw-logprobs default) → duet's record."""
    top = sorted(((t, float(lp.logprob)) for t, lp in d.items()), key=lambda x: -x[1])[:n]
    return TokenLogprob(token_id=tok, logprob=float(d[tok].logprob), top=top, rank=d[tok].rank)


def _records(token_ids: list[int], dicts: Any, n: int) -> list[TokenLogprob | None]:
    """`_record` per position; a None position (the first prompt token) stays None."""
    return [
        None if d is None else _record(tok, d, n) for tok, d in zip(token_ids, dicts, strict=True)
    ]


class VllmStream:
    """One request's vLLM output collector seen through the interface."""

    #: always None: vLLM reserves remote-KV blocks itself
    reserved: asyncio.Future[list[int]] | None = None

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        collector: Any,
        arrival: float,
        on_handoff: Callable[[], None],
        params: SamplingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self._params = params
        self._on_handoff = on_handoff
        self.prompt_token_ids = prompt_token_ids
        self._collector = collector
        self._arrival = arrival

    @property
    def num_cached_blocks(self) -> int:
        return 0

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Delta]:
        from vllm.v1.engine.exceptions import EngineDeadError

        n_out = 0
        first_token: float | None = None
        while True:
            try:
                out = self._collector.get_nowait() or await self._collector.get()
            except EngineDeadError as e:
                raise EngineDead(str(e) or "vLLM's engine core died") from e
            except Exception as e:  # this request failed inside vLLM; the others go on
                yield Delta(
                    request_id=self.request_id,
                    new_token_ids=[],
                    new_text="",
                    finished=True,
                    finish_reason="error",
                    error=f"{type(e).__name__}: {e}",
                    num_prompt_tokens=len(self.prompt_token_ids),
                    num_output_tokens=n_out,
                )
                return
            c = out.outputs[0] if out.outputs else None
            new_ids = list(c.token_ids) if c is not None else []
            n_out += len(new_ids)
            now = asyncio.get_running_loop().time()
            if new_ids and first_token is None:
                first_token = now
            reason = c.finish_reason if c is not None and out.finished else None
            error = None
            if reason == "error":
                error = (
                    "vLLM failed the request (a KV load that failed under the fail policy, "
                    "or an engine error)"
                )
            delta = Delta(
                request_id=self.request_id,
                new_token_ids=new_ids,
                new_text=c.text if c is not None else "",
                finished=out.finished,
                finish_reason=reason,
                error=error,
                stop_reason=c.stop_reason if c is not None else None,
                num_prompt_tokens=len(self.prompt_token_ids),
                num_cached_tokens=int(out.num_cached_tokens or 0),
                num_output_tokens=n_out,
            )
            p = self._params
            if (
                p is not None
                and p.logprobs is not None
                and c is not None
                and c.logprobs is not None
            ):
                # every generated position has its dict (only the first prompt token has none)
                delta.logprobs = [
                    _record(t, d, p.logprobs) for t, d in zip(new_ids, c.logprobs, strict=True)
                ]
            if (
                p is not None
                and p.prompt_logprobs is not None
                and getattr(out, "prompt_logprobs", None)
            ):
                delta.prompt_logprobs = _records(
                    self.prompt_token_ids, out.prompt_logprobs, p.prompt_logprobs
                )
            if out.finished:
                delta.kv_transfer_params = kv_params_from_vllm(out.kv_transfer_params)
                if (
                    delta.kv_transfer_params is not None
                    and delta.kv_transfer_params.do_remote_prefill
                ):
                    self._on_handoff()
                delta.arrival_time, delta.first_token_time = self._arrival, first_token
            yield delta
            if out.finished:
                return

"""What an external model's call bills: the provider's own usage figures, also after the client
left.

A provider bills the operator its whole answer, whether the client stays or not. So when a
client leaves — a stream closed before the provider's usage chunk, a whole answer it stopped
waiting for — the call is read on, `ABANDONED_READ_S` and n × max_tokens chunks at most, for the
provider's usage (`stream_abandoned`, `answer_abandoned`); a provider that answers but does not
report it in that time is billed the reservation's worst case (`worst_case`: the prompt's upper
bound and every max_token), never a guess below what the operator pays.

Invariant: `Accounting.usage_reported` is set exactly when the figures are the provider's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any

from gateway.backends.base import Accounting, Attempt
from gateway.backends.providers.cost import TokenUsage
from gateway.backends.providers.errors import ProviderError

log = logging.getLogger("duet.gateway.providers")
#: after its client left, a provider's answer is awaited this long at most for its usage
ABANDONED_READ_S = 10.0


def usage_chunk(out: Accounting, chunk: dict[str, Any], provider: str) -> bool:
    """Whether `chunk` is the stream's usage chunk (then counted into `out`)."""
    if chunk.get("usage") is None or chunk.get("choices"):
        return False
    usage = TokenUsage.from_openai(chunk["usage"])
    if usage is not None:
        answered(out, usage, provider)
        out.completion_tokens = split(usage.completion_tokens, out.completion_tokens)
        out.usage_reported = True
    return True


async def stream_abandoned(
    it: AsyncGenerator[dict[str, Any], None],
    step: asyncio.Future[dict[str, Any] | None] | None,
    out: Accounting,
    attempt: Attempt,
    n: int,
    provider: str,
) -> None:
    """The client left mid-stream: the provider bills the whole answer it is making, so
    read its stream on — `ABANDONED_READ_S` and n × max_tokens chunks at most — for its
    usage; a provider that answered but does not report it in time is billed the reserved
    worst case (one that never sent a chunk: its prompt, as before)."""
    if out.usage_reported:
        return
    budget = n * attempt.max_tokens + 16  # content chunks, the finish and usage ones
    answering = out.served  # the provider has begun its answer (else: only the prompt is owed)
    try:
        async with asyncio.timeout(ABANDONED_READ_S):
            chunk = await step if step is not None else await anext(it, None)
            while chunk is not None and budget > 0:
                answering = True
                if usage_chunk(out, chunk, provider) and out.usage_reported:
                    return
                budget -= 1
                chunk = await anext(it, None)
    except (ProviderError, TimeoutError, RuntimeError):
        pass  # a broken or slow stream: the worst case below
    if step is not None and not step.done():
        step.cancel()  # and ended before the stream is closed (it cannot close mid-read)
        with contextlib.suppress(BaseException):
            await step
    if answering:  # a provider that never answered a chunk bills its prompt, as a failure does
        worst_case(out, attempt, n, provider)


async def answer_abandoned(
    call: asyncio.Future[Any], out: Accounting, attempt: Attempt, n: int, provider: str
) -> None:
    """The client of a whole answer left while the provider answers: the provider bills it,
    so wait for it (`ABANDONED_READ_S` at most) and bill its usage, else the worst case; a
    provider that failed bills nothing but the prompt, as before."""
    log.info("%s: the client left: awaiting the provider's answer", attempt.request_id)
    try:
        async with asyncio.timeout(ABANDONED_READ_S):
            result = await call
    except ProviderError:
        return
    except TimeoutError:
        call.cancel()
        worst_case(out, attempt, n, provider)
        return
    answered(out, result.usage, provider)
    out.completion_tokens = split(result.usage.completion_tokens, {i: 0 for i in range(n)})
    out.usage_reported = True


def worst_case(out: Accounting, attempt: Attempt, n: int, provider: str) -> None:
    """What the reservation holds: the prompt's upper bound and n full completions."""
    out.prompt_tokens = max(out.prompt_tokens, attempt.reserved_prompt_tokens)
    out.completion_tokens = {i: attempt.max_tokens for i in range(n)}
    if not out.nodes:
        out.nodes.append(f"provider:{provider}")
    log.info(
        "%s: the provider reported no usage after its client left: billed the worst case",
        attempt.request_id,
    )


def answered(out: Accounting, usage: TokenUsage, provider: str) -> None:
    """The provider's own figures for its answer, into `out`."""
    out.prompt_tokens = usage.prompt_tokens
    out.cached_tokens = usage.cached_tokens
    # the provider's figure, none included: a cache it wrote nothing to bills no writes,
    # whatever prefix the client marked
    out.reported_cache_writes = usage.cache_write_tokens
    if not out.nodes:
        out.nodes.append(f"provider:{provider}")


def split(total: int, per_sample: dict[int, int]) -> dict[int, int]:
    """The provider's completion total over the samples (it reports one figure for all n)."""
    if not per_sample:
        return {0: total}
    counted = sum(per_sample.values())
    if counted == total:
        return per_sample
    keys = sorted(per_sample)
    out = {k: total // len(keys) for k in keys}
    out[keys[0]] += total - sum(out.values())
    return out

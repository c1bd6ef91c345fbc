"""The load `duet bench chaos` runs while it kills processes, and how each answer is judged.

Three kinds of client against the gateway's OpenAI API, all greedy (temperature 0) on a fixed
set of chat prompts whose reference answers are taken once before the first kill:
- `stream`: interactive streams (`stream: true`, usage in the last chunk), back to back;
- `plain`: non-streamed requests, back to back;
- `batch`: one simple batch job (`POST /v1/batch`), polled until it ends (bench/chaos_batch.py).

Every request ends in one `Outcome`:
- FULL: the whole answer (`[DONE]` after the content, or a complete JSON body);
- DEFINED_ERROR: an HTTP error with OpenAI's error body, or an SSE `error` event — the client
  was told what happened (tokens it got before an error event still count as received);
- PARTIAL: a stream whose connection was cut after its first tokens (its gateway died: a
  SIGKILLed process's connections die with it, and neither the SDKs nor the protocol resume a
  stream) — answered with tokens, not in full;
- UNDEFINED: a connection error before any token, a hang past the timeout, a stream that ends
  without `[DONE]`, or an answer that is not OpenAI-shaped.

A connection refused or reset before any byte of the answer (the gateway it reached was
SIGKILLed; with `duet up --gateways 2` the other one takes the port's connections), and a 429 or
503 (the cluster had no capacity for it: both decode nodes out at once), are sent again up to
twice, as the official SDKs do (`max_retries=2`), after the answer's `Retry-After` (at most
`MAX_RETRY_AFTER_S`; without one, 0.5 s then 1 s), under the same `Idempotency-Key` (one per
request), so the gateway bills the request once whichever attempt it saw. Other errors are the
answer (a 500 or 502 may have cost a node's work), and a stream cut after its first byte is not
sent again (its text was delivered). Each request carries a tag of its own in the OpenAI `user`
field, the same on its retries, so the gateway's usage records can be matched to it whatever
became of each attempt (bench/chaos_usage.py), and the X-Request-Id of the attempt that was
answered.

A full answer whose text or finish reason differs from the reference is flagged
(`differs_from_reference`). With `strict_text` it is UNDEFINED (the check that matters
once streams migrate: repeated or missing text); without, it stays FULL and is only counted,
because greedy decoding on the native engine is not batch-invariant in bf16 (a different batch
composition can flip a near-tie), so a difference alone does not prove that chaos broke it.

Invariant: a client never raises; a failure is a record, and the run goes on.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
import uuid
from typing import Any

import aiohttp
import msgspec

from bench.sse_client import sse_events
from protocol.openai import ErrorBody

#: fixed chat prompts (varied lengths, so some span several KV blocks)
PROMPTS = (
    "Say hello.",
    "List three colours.",
    "Write one sentence about the sea.",
    "What is the capital of France? Answer in a sentence.",
    "Explain in two sentences why the sky looks blue during the day, for a ten year old.",
    "Count from one to ten in words, separated by commas.",
    "Give me a short recipe for a cup of tea, in numbered steps, with quantities for one cup.",
    "Name a planet of the solar system and one fact about it.",
)


class Outcome(enum.StrEnum):
    FULL = "full"
    DEFINED_ERROR = "defined_error"
    PARTIAL = "partial"
    UNDEFINED = "undefined"


class Record(msgspec.Struct, kw_only=True):
    kind: str  # stream | plain | batch
    prompt: int
    #: seconds since the run's start
    sent_s: float
    end_s: float = 0.0
    outcome: Outcome = Outcome.UNDEFINED
    cause: str = ""
    message: str = ""
    ttft_s: float | None = None
    #: completion tokens the client received (usage when the answer had it, else chunks)
    tokens: int = 0
    #: the gateway answered (a body or a stream), whatever it said: it should have billed it
    answered: bool = False
    #: a full answer whose text differs from the greedy reference
    differs_from_reference: bool = False
    #: the OpenAI `user` field it was sent with (unique per request, kept on its retry)
    tag: str = ""
    #: the gateway's X-Request-Id of the answer (empty: no answer came)
    request_id: str = ""
    #: an attempt met a refused or reset connection and it was sent again
    retried: bool = False
    #: attempts answered 429 or 503 and sent again after their Retry-After
    busy_retries: int = 0


class Reference(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    finish_reason: str | None


def chat_body(
    model: str, prompt: int, max_tokens: int, stream: bool, tag: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[prompt]}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if tag is not None:
        body["user"] = tag
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


#: answers the SDKs send again: the gateway did no work for them and says when to come back
RETRY_STATUSES = (429, 503)
#: the longest Retry-After the client waits (the SDKs wait up to 60 s; a chaos run is short)
MAX_RETRY_AFTER_S = 8.0


class _Busy(Exception):
    """A 429 or 503 with attempts left: sent again after `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(delay_s)
        self.delay_s = delay_s


def _retry_after_s(r: aiohttp.ClientResponse, attempt: int) -> float:
    try:
        given = float(r.headers.get("Retry-After", ""))
    except ValueError:
        given = -1.0
    if 0 <= given <= MAX_RETRY_AFTER_S:
        return given
    return min(0.5 * 2**attempt, MAX_RETRY_AFTER_S)


def _error_answer(rec: Record, status: int, raw: bytes) -> Record:
    rec.answered = True
    try:
        err = msgspec.json.decode(raw, type=ErrorBody).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        rec.outcome, rec.cause, rec.message = (
            Outcome.UNDEFINED,
            f"http_{status}_not_openai",
            raw[:200].decode(errors="replace"),
        )
        return rec
    rec.outcome, rec.cause, rec.message = Outcome.DEFINED_ERROR, f"http_{status}", err.message[:300]
    return rec


def _judge(
    rec: Record, text: str, finish: str | None, ref: Reference | None, strict_text: bool
) -> Record:
    rec.outcome, rec.cause = Outcome.FULL, "ok"
    if ref is not None and (text, finish) != (ref.text, ref.finish_reason):
        rec.differs_from_reference = True
        rec.message = (
            f"got {text[:80]!r} ({finish}), reference {ref.text[:80]!r} ({ref.finish_reason})"
        )
        if strict_text:
            rec.outcome, rec.cause = Outcome.UNDEFINED, "text_mismatch"
    return rec


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
    rec: Record,
    ref: Reference | None,
    strict_text: bool,
    attempt: int = 2,
) -> Record:
    start = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        rec.request_id = r.headers.get("X-Request-Id", "")
        if r.status in RETRY_STATUSES and attempt < 2:
            raise _Busy(_retry_after_s(r, attempt))
        if r.status != 200:
            return _error_answer(rec, r.status, await r.content.read(4096))
        rec.answered = True
        parts: list[str] = []
        finish, usage, chunks, done = None, None, 0, False
        async for event, data in sse_events(r.content):
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if event == "error" or "error" in chunk:
                err = chunk.get("error", chunk)
                rec.outcome, rec.cause = Outcome.DEFINED_ERROR, "sse_error"
                rec.message = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
                rec.tokens = chunks
                return rec
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    if rec.ttft_s is None:
                        rec.ttft_s = time.perf_counter() - start
                    parts.append(piece)
                    chunks += 1
                    rec.tokens = chunks  # what a cut leaves the client with
                finish = choice.get("finish_reason") or finish
            if isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"].get("completion_tokens")
        rec.tokens = usage if isinstance(usage, int) else chunks
        if not done:
            rec.outcome, rec.cause = Outcome.UNDEFINED, "incomplete_stream"
            rec.message = f"the stream ended after {chunks} chunks without [DONE]"
            return rec
        return _judge(rec, "".join(parts), finish, ref, strict_text)


async def _plain(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
    rec: Record,
    ref: Reference | None,
    strict_text: bool,
    attempt: int = 2,
) -> Record:
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        # before the body: a cut body is not sent again
        rec.request_id = r.headers.get("X-Request-Id", "")
        if r.status in RETRY_STATUSES and attempt < 2:
            raise _Busy(_retry_after_s(r, attempt))
        raw = await r.read()
        if r.status != 200:
            return _error_answer(rec, r.status, raw)
    rec.answered = True
    answer = json.loads(raw)
    choice = answer["choices"][0]
    rec.tokens = int(answer["usage"]["completion_tokens"])
    return _judge(
        rec, choice["message"]["content"] or "", choice.get("finish_reason"), ref, strict_text
    )


#: errors that mean no answer came at all: the connection was refused, or reset or closed before
#: the answer's status line (a SIGKILLed gateway's)
_NO_ANSWER = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    ConnectionError,
)


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    model: str,
    kind: str,
    prompt: int,
    max_tokens: int,
    ref: Reference | None,
    t0: float,
    timeout: float,
    strict_text: bool = False,
    tag: str = "",
) -> Record:
    rec = Record(kind=kind, prompt=prompt, sent_s=time.monotonic() - t0, tag=tag)
    # one key per request, the same on its retry: the gateway bills its attempts once (an
    # attempt that died with its gateway is billed `expired` until the retry's record replaces it)
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": uuid.uuid4().hex}
    body = chat_body(model, prompt, max_tokens, stream=kind == "stream", tag=tag or None)
    try:
        async with asyncio.timeout(timeout):
            for attempt in range(3):
                send = _stream if kind == "stream" else _plain
                try:
                    await send(session, url, headers, body, rec, ref, strict_text, attempt)
                    break
                except _Busy as busy:
                    rec.busy_retries += 1
                    rec.request_id = ""
                    await asyncio.sleep(busy.delay_s)
                except _NO_ANSWER:
                    if attempt == 2 or rec.answered or rec.request_id:
                        raise  # a third failure, or the answer had begun: not sent again
                    rec.retried = True
    except TimeoutError:
        rec.outcome, rec.cause, rec.message = (
            Outcome.UNDEFINED,
            "timeout",
            f"no complete answer within {timeout:g} s",
        )
    except (aiohttp.ClientError, ConnectionError) as e:
        cut = kind == "stream" and rec.tokens > 0
        rec.outcome, rec.cause, rec.message = (
            Outcome.PARTIAL if cut else Outcome.UNDEFINED,
            "cut_after_tokens" if cut else "connection_error",
            f"{type(e).__name__}: {e}"[:300],
        )
    except (ValueError, KeyError, TypeError, IndexError) as e:
        rec.outcome, rec.cause, rec.message = (
            Outcome.UNDEFINED,
            "bad_response",
            f"{type(e).__name__}: {e}"[:300],
        )
    rec.end_s = time.monotonic() - t0
    return rec


async def references(
    session: aiohttp.ClientSession, url: str, key: str, model: str, max_tokens: int, timeout: float
) -> dict[int, Reference]:
    """Each prompt's greedy answer on the whole cluster, before any kill (three tries each)."""
    refs: dict[int, Reference] = {}
    headers = {"Authorization": f"Bearer {key}"}
    for i in range(len(PROMPTS)):
        last = ""
        for _ in range(3):
            try:
                async with asyncio.timeout(timeout):
                    async with session.post(
                        url + "/v1/chat/completions",
                        headers=headers,
                        json=chat_body(model, i, max_tokens, stream=False),
                    ) as r:
                        raw = await r.read()
                if r.status == 200:
                    choice = json.loads(raw)["choices"][0]
                    refs[i] = Reference(
                        text=choice["message"]["content"] or "",
                        finish_reason=choice.get("finish_reason"),
                    )
                    break
                last = f"HTTP {r.status}: {raw[:200]!r}"
            except (TimeoutError, aiohttp.ClientError) as e:
                last = repr(e)
        else:
            raise RuntimeError(f"no reference answer for prompt {i} before the chaos: {last}")
    return refs

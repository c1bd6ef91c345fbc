"""Sends one streamed OpenAI request and fills its RequestRecord: TTFT at the first content
chunk, the arrival time of every content chunk (ITL), usage from the final chunk, and on
failure one cause (HTTP status, timeout, connection error, SSE error event, incomplete
stream, no output, malformed answer).

Invariants: never raises (a failed request is a record, not an exception: the run goes on);
never follows a redirect (bench sends only to the URL it was given); the whole request,
stream included, is bounded by `timeout`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from bench.records import RequestRecord
from protocol.sse import read_to_end

_MAX_ERROR_BODY = 4096
#: how long a server may take to end its body after `[DONE]` before its connection is given up
END_TIMEOUT_S = 1.0


async def send(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    rec: RequestRecord,
    timeout: float,
    run_start: float,
) -> RequestRecord:
    start = time.perf_counter()
    rec.sent_s = start - run_start
    end: float | None = None
    try:
        async with asyncio.timeout(timeout):
            end = await _exchange(session, url, payload, headers, rec, start)
    except TimeoutError:
        rec.fail("timeout", f"no complete answer within {timeout:g} s")
    except aiohttp.ClientConnectorError as e:
        rec.fail("connection_error", str(e))
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        # a drop after the first chunk cut a stream short; before it, the server never answered
        rec.fail(
            "incomplete_stream" if rec.chunk_s else "connection_error", str(e) or type(e).__name__
        )
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # JSON and shape errors
        rec.fail("bad_response", f"{type(e).__name__}: {e}")
    except aiohttp.ClientError as e:
        rec.fail("client_error", f"{type(e).__name__}: {e}")
    except Exception as e:  # one odd answer must not end the run (the invariant above)
        rec.fail("client_error", f"{type(e).__name__}: {e}")
    rec.e2el_s = (end or time.perf_counter()) - start
    return rec


async def _exchange(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    rec: RequestRecord,
    start: float,
) -> float | None:
    """Fills `rec`; returns when `[DONE]` arrived (the request's end), if it did."""
    end = None
    async with session.post(url, json=payload, headers=headers, allow_redirects=False) as resp:
        if resp.status != 200:
            rec.fail(f"http_{resp.status}", await _error_message(resp))
            return None
        if resp.content_type != "text/event-stream":
            raise ValueError(
                f"expected an SSE stream (text/event-stream), got {resp.content_type or 'no type'}"
            )
        done = False
        async for event, data in sse_events(resp.content):
            if data == "[DONE]":
                done = True
                end = time.perf_counter()
                await finish_body(resp)
                break
            chunk = json.loads(data)
            if event == "error" or (isinstance(chunk, dict) and "error" in chunk):
                err = chunk.get("error", chunk) if isinstance(chunk, dict) else chunk
                rec.fail("sse_error", _message_of(err))
                return None
            if not isinstance(chunk, dict):
                raise ValueError(f"an SSE data line is not a JSON object: {data[:100]}")
            _take_chunk(chunk, rec, time.perf_counter() - start)
    if not done:
        rec.fail(
            "incomplete_stream", f"stream ended after {len(rec.chunk_s)} chunks without [DONE]"
        )
    elif not rec.chunk_s:
        rec.fail("no_output", "the stream finished without a content token")
    else:
        rec.ok = True
        if not rec.usage_tokens:
            rec.output_tokens = sum(rec.chunk_tokens)
    return end


async def finish_body(resp: aiohttp.ClientResponse) -> None:
    """Read past `[DONE]` to the body's end (protocol/sse.py says why), as the official
    openai client's async streams do, so the connection goes back to the pool. A server that
    does not end the body within END_TIMEOUT_S loses the connection; the answer was whole all
    the same."""
    await read_to_end(resp, END_TIMEOUT_S)


def _take_chunk(chunk: dict[str, Any], rec: RequestRecord, now: float) -> None:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        if delta is not None:  # chat
            text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        else:
            text = choice.get("text") or ""
        token_ids = choice.get("token_ids")
        if rec.text is not None:
            rec.text += text
        if text or token_ids:
            if rec.ttft_s is None:
                rec.ttft_s = now
            rec.chunk_s.append(now)
            rec.chunk_tokens.append(len(token_ids) if token_ids else 1)
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens = usage["completion_tokens"]
        rec.usage_tokens = True
        rec.usage_prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = details.get("cached_tokens")


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[tuple[str, str]]:
    """A stream's `data:` payloads with their event type ("" unless an `event:` line named one;
    a blank line ends an event, so its type does not carry over), in order."""
    event = ""
    async for raw in content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            event = ""
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            yield event, line[5:].strip()


async def _error_message(resp: aiohttp.ClientResponse) -> str:
    body = (await resp.content.read(_MAX_ERROR_BODY)).decode(errors="replace")
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        err = None
    return _message_of(err) if err else (body.strip()[:500] or resp.reason or "")


def _message_of(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)

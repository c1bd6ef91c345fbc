"""The chaos client against a real HTTP server standing in for a gateway that is SIGKILLed:
a connection reset before any byte of the answer, or a 503, is sent again up to twice as the
SDKs do (with the same `user` tag and `Idempotency-Key`), a stream cut after its first bytes
is not (its text was delivered), and the usage check matches the gateway's records to the
client's requests one by one — a full answer billed once, a retried request billed twice,
records of answers the client never got — where the totals alone were off by one or two either
way."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from bench.chaos_batch import BatchResult
from bench.chaos_load import Outcome, Record, one_request
from bench.chaos_usage import check
from runtime.ports import free_port

ANSWER = {
    "id": "c",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi there"},
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


def _reset(request: web.Request) -> None:
    """Drop the connection with a TCP RST, as the kernel does for a killed process's sockets."""
    sock = request.transport.get_extra_info("socket")  # type: ignore[union-attr]
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    request.transport.close()  # type: ignore[union-attr]


@asynccontextmanager
async def gateway(
    resets: int,
    cut_stream: bool = False,
    busy: int = 0,
    status: int = 503,
    empty_first: bool = False,
) -> AsyncIterator[tuple[str, list[dict]]]:
    """A server that resets its first `resets` requests before answering, answers the next
    `busy` with `status` (an OpenAI error, `Retry-After: 0.2`), then answers (a stream cut after
    its first chunk with `cut_stream`; that chunk without text with `empty_first`). Yields its
    URL and the bodies seen."""
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({**body, "idempotency_key": request.headers.get("Idempotency-Key")})
        if len(seen) <= resets:
            _reset(request)
            await asyncio.sleep(1)
            return web.Response()
        if len(seen) <= resets + busy:
            err = {"error": {"message": "no capacity", "type": "x", "code": "no_capacity"}}
            return web.json_response(
                err, status=status, headers={"Retry-After": "0.2", "X-Request-Id": "req-busy"}
            )
        if body.get("stream"):
            r = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "X-Request-Id": f"req-{len(seen)}"}
            )
            await r.prepare(request)
            delta = {"role": "assistant"} if empty_first else {"content": "hi"}
            chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            await r.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if cut_stream:
                _reset(request)
                await asyncio.sleep(1)
                return r
            await r.write(b"data: [DONE]\n\n")
            return r
        return web.json_response(ANSWER, headers={"X-Request-Id": f"req-{len(seen)}"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def _ask(url: str, kind: str) -> Record:
    async with aiohttp.ClientSession() as s:
        return await one_request(s, url, "k", "m", kind, 0, 8, None, 0.0, 10, tag="chaos-plain-0-7")


def test_a_reset_before_the_answer_is_sent_again_once_with_its_tag() -> None:
    async def main() -> None:
        async with gateway(resets=1) as (url, seen):
            rec = await _ask(url, "plain")
            assert (
                rec.outcome == Outcome.FULL
                and rec.retried
                and rec.tokens == 2
                and rec.request_id == "req-2"
            )
            assert [b["user"] for b in seen] == ["chaos-plain-0-7"] * 2  # the same tag on the retry
            # and the same Idempotency-Key: the gateway bills the two attempts once
            assert seen[0]["idempotency_key"] and len({b["idempotency_key"] for b in seen}) == 1
            again = await _ask(url, "plain")  # another request: another key
            assert again.outcome == Outcome.FULL and seen[2]["idempotency_key"] not in (
                seen[0]["idempotency_key"],
                None,
            )
        async with gateway(resets=3) as (url, seen):  # twice only: a third reset is the answer
            rec = await _ask(url, "stream")
            assert (
                rec.outcome == Outcome.UNDEFINED and rec.cause == "connection_error" and rec.retried
            )
            assert len(seen) == 3

    asyncio.run(main())


def test_a_503_is_sent_again_after_its_retry_after_as_the_sdks_do() -> None:
    async def main() -> None:
        async with gateway(resets=0, busy=2) as (url, seen):
            for kind in ("stream", "plain"):
                seen.clear()
                rec = await _ask(url, kind)
                assert rec.outcome == Outcome.FULL and rec.busy_retries == 2, rec
                assert not rec.retried and rec.request_id == "req-3"
                assert len({b["idempotency_key"] for b in seen}) == 1 and len(seen) == 3
        async with gateway(resets=0, busy=3) as (url, seen):  # the third 503 is the answer
            rec = await _ask(url, "plain")
            assert rec.outcome == Outcome.DEFINED_ERROR and rec.cause == "http_503"
            assert rec.busy_retries == 2 and len(seen) == 3
        async with gateway(resets=0, busy=1, status=500) as (url, seen):  # not sent again
            rec = await _ask(url, "plain")
            assert rec.outcome == Outcome.DEFINED_ERROR and rec.cause == "http_500"
            assert rec.busy_retries == 0 and len(seen) == 1

    asyncio.run(main())


def test_a_stream_cut_after_its_first_bytes_is_not_sent_again() -> None:
    """Its text was delivered: it is answered in part (the tokens it got), not sent again."""

    async def main() -> None:
        async with gateway(resets=0, cut_stream=True) as (url, seen):
            rec = await _ask(url, "stream")
            assert rec.outcome == Outcome.PARTIAL and rec.cause == "cut_after_tokens"
            assert rec.tokens == 1 and not rec.retried and len(seen) == 1
            assert rec.answered and rec.request_id == "req-1"
        # cut after its headers but before any token: no answer at all
        async with gateway(resets=0, cut_stream=True, empty_first=True) as (url, seen):
            rec = await _ask(url, "stream")
            assert rec.outcome == Outcome.UNDEFINED and rec.cause == "connection_error"
            assert rec.tokens == 0 and not rec.retried and len(seen) == 1

    asyncio.run(main())


def _rec(tag: str, rid: str, outcome: Outcome, tokens: int, retried: bool = False) -> Record:
    return Record(
        kind="plain",
        prompt=0,
        sent_s=0.0,
        tag=tag,
        request_id=rid,
        outcome=outcome,
        tokens=tokens,
        answered=bool(rid),
        retried=retried,
    )


def _row(tag: str | None, rid: str, status: str, completion: int, cost: float = 0.0) -> dict:
    return {
        "user": tag,
        "request_id": rid,
        "status": status,
        "completion_tokens": completion,
        "prompt_tokens": 9,
        "cost_usd": cost,
    }


def test_the_usage_check_matches_records_to_requests_one_by_one() -> None:
    records = [
        _rec("chaos-a", "req-1", Outcome.FULL, 8),
        _rec(
            "chaos-b", "req-2", Outcome.FULL, 8, retried=True
        ),  # its first attempt died with a gateway
        _rec(
            "chaos-c", "", Outcome.UNDEFINED, 0
        ),  # the answer died with its gateway, record written
        _rec("chaos-d", "req-4", Outcome.UNDEFINED, 3),  # a stream cut mid-way: the booking expired
    ]
    batch = BatchResult(
        lines=1, status="completed", succeeded=1, completion_tokens=8, line_tokens={"chaos-0": 8}
    )
    rows = [
        _row("chaos-a", "req-1", "ok", 8),
        _row("chaos-b", "req-2", "ok", 8),
        _row("chaos-c", "req-3", "ok", 8),
        _row("chaos-d", "req-4", "expired", 0),
        _row("chaos-0", "batch-1", "ok", 8),
        _row(None, "req-ref", "ok", 8),
    ]
    # The totals differ both ways (6 records vs 4 answered + 1 line; 40 tokens vs 27) though
    # every answer was billed once: only the per-request match can say so.
    c = check(records, batch, rows)
    assert c.ok and c.full_answers == 3 and c.exact == 3 and c.retried == 1, c
    assert c.records == {"ok": 4, "expired": 1} and c.no_full_answer == {"ok": 1, "expired": 1}
    assert c.no_full_answer_tokens == 8
    # the retried request's lost first attempt billed too: caught
    c = check(records, batch, [*rows, _row("chaos-b", "req-x", "expired", 0, cost=0.001)])
    assert not c.ok and c.billed_twice == {"chaos-b": ["ok", "expired"]}
    # an answer billed with other tokens, a record written twice, a record of no request sent
    bad = [
        _row("chaos-a", "req-1", "ok", 7),
        _row("chaos-b", "req-2", "ok", 8),
        _row("chaos-b", "req-2", "ok", 8),
        _row("chaos-0", "batch-1", "ok", 8),
        _row("chaos-zz", "req-9", "ok", 1),
    ]
    c = check(records, batch, bad)
    assert (
        not c.ok and set(c.mismatched) == {"chaos-a", "chaos-b"} and c.unknown == 1 and c.exact == 1
    ), c
    assert check(records, batch, "usage records not readable: refused").error

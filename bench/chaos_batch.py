"""The batch client of `duet bench chaos`: one simple batch job (`POST /v1/batch`) submitted
and polled through the chaos, and whether each of its lines was done exactly once.

Invariant: a failed submit or poll is tried again until the deadline (the gateway it reached
may be restarting); the result says what happened, never raises.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec

from bench.chaos_load import PROMPTS, chat_body


class BatchResult(msgspec.Struct, kw_only=True):
    batch_id: str | None = None
    status: str = "not_submitted"
    lines: int = 0
    #: custom ids in the output, and how many times each appeared
    done_once: int = 0
    duplicated: list[str] = msgspec.field(default_factory=list)
    missing: list[str] = msgspec.field(default_factory=list)
    succeeded: int = 0
    failed: int = 0
    completion_tokens: int = 0
    #: completion tokens of each line answered in full, by custom id
    line_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    message: str = ""

    @property
    def exactly_once(self) -> bool:
        return self.status == "completed" and not self.duplicated and not self.missing


async def run_batch(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    model: str,
    lines: int,
    max_tokens: int,
    deadline: float,
) -> BatchResult:
    """Submit one simple batch of `lines` requests and poll it (through the chaos: a failed poll
    is retried) until it ends or `deadline` (monotonic) passes."""
    res = BatchResult(lines=lines)
    if lines <= 0:
        return res
    headers = {"Authorization": f"Bearer {key}"}
    ids = [f"chaos-{i}" for i in range(lines)]
    reqs = [
        {
            "custom_id": cid,
            "body": chat_body(model, i % len(PROMPTS), max_tokens, stream=False, tag=cid),
        }
        for i, cid in enumerate(ids)
    ]
    while res.batch_id is None and time.monotonic() < deadline:
        try:
            async with session.post(
                url + "/v1/batch", json={"requests": reqs}, headers=headers
            ) as r:
                body = await r.json(content_type=None)
                if r.status == 202:
                    res.batch_id, res.status = body["batch_id"], body["status"]
                else:
                    res.message = f"submit: HTTP {r.status}: {str(body)[:200]}"
        except (aiohttp.ClientError, ValueError, TimeoutError) as e:
            res.message = f"submit: {e!r}"[:300]
        if res.batch_id is None:
            await asyncio.sleep(1.0)  # the gateway may be restarting: try again
    results = None
    while res.batch_id is not None and time.monotonic() < deadline:
        try:
            # one page holds every line up to 1000 (docs/batch.md: limit, after)
            page = {"limit": str(min(max(lines, 1), 1000))}
            async with session.get(
                f"{url}/v1/batch/{res.batch_id}", params=page, headers=headers
            ) as r:
                body = await r.json(content_type=None)
            if r.status == 200:
                res.status = body["status"]
                if body.get("results") is not None:
                    results = body["results"]
                    break
        except (aiohttp.ClientError, ValueError, TimeoutError) as e:
            res.message = f"poll: {e!r}"[:300]
        await asyncio.sleep(2.0)  # polling interval of a batch job
    if results is None:
        if res.batch_id is not None:
            res.message = res.message or f"still {res.status} at the deadline"
        return res
    seen: dict[str, int] = {}
    for line in results:
        seen[line["custom_id"]] = seen.get(line["custom_id"], 0) + 1
        resp = line.get("response")
        if resp and resp.get("status_code") == 200:
            res.succeeded += 1
            tokens = int(resp["body"]["usage"]["completion_tokens"])
            res.completion_tokens += tokens
            res.line_tokens[line["custom_id"]] = tokens
        else:
            res.failed += 1
    res.done_once = sum(1 for cid in ids if seen.get(cid) == 1)
    res.duplicated = sorted(cid for cid, n in seen.items() if n > 1)
    res.missing = sorted(cid for cid in ids if cid not in seen)
    return res

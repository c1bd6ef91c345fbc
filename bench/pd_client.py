"""A minimal client for the node API: one completion, colocated or disaggregated (P → D),
as the gateway drives it (DESIGN §1 steps 3-4). Used by bench.pd and the node tests.

Streams are read as OpenAI SSE; the result keeps token ids, text, finish reason, usage, the
node's timing breakdown, an `error` event if one came, and the client-side TTFT.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.sse_client import finish_body


@dataclass
class Result:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timing: dict[str, float] = field(default_factory=dict)
    prefill_timing: dict[str, float] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    ttft: float | None = None
    #: perf_counter() at each chunk that carried tokens (inter-token gaps: bench/pd_mix.py)
    token_times: list[float] = field(default_factory=list)
    latency: float = 0.0
    prefill_seconds: float = 0.0


async def read_sse(resp: aiohttp.ClientResponse, result: Result, t0: float) -> Result:
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        if payload == b"[DONE]":
            await finish_body(resp)  # the connection goes back to the pool for the next request
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            result.error = chunk["error"]
            continue
        for choice in chunk.get("choices", []):
            if choice.get("token_ids"):
                now = time.perf_counter()
                result.token_times.append(now)
                if result.ttft is None:
                    result.ttft = now - t0
            result.token_ids.extend(choice.get("token_ids") or [])
            result.text += choice.get("text", "")
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if chunk.get("usage"):
            result.usage = chunk["usage"]
        if chunk.get("timing"):
            result.timing = chunk["timing"]
    return result


async def completion(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int] | str,
    params: dict[str, Any],
    request_id: str | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    t0: float | None = None,
) -> Result:
    """A streamed completion on one node (colocated, or the decode leg when given params)."""
    rid = request_id or f"cmpl-{uuid.uuid4().hex}"
    t0 = time.perf_counter() if t0 is None else t0
    body = {"prompt": prompt, "stream": True, **params}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    result = Result(rid)
    async with session.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        if r.status != 200:
            result.error = (await r.json()).get("error", {"message": await r.text()})
            result.error["status"] = r.status
            return result
        await read_sse(r, result, t0)
    result.latency = time.perf_counter() - t0
    return result


async def prefill_leg(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int] | str,
    params: dict[str, Any],
    request_id: str,
) -> dict[str, Any]:
    """The prefill leg; returns the node's JSON (with kv_transfer_params) or raises."""
    body = {
        "prompt": prompt,
        **params,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    async with session.post(
        f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}
    ) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"prefill leg failed with {r.status}: {data}")
        return data


async def disaggregated(
    session: aiohttp.ClientSession,
    p_url: str,
    d_url: str,
    prompt: list[int] | str,
    params: dict[str, Any],
    request_id: str | None = None,
) -> Result:
    rid = request_id or f"cmpl-{uuid.uuid4().hex}"
    t0 = time.perf_counter()
    pre = await prefill_leg(session, p_url, prompt, params, rid)
    t_pre = time.perf_counter() - t0
    result = await completion(session, d_url, prompt, params, rid, pre["kv_transfer_params"], t0=t0)
    result.prefill_seconds = t_pre
    result.prefill_timing = pre.get("timing") or {}
    return result

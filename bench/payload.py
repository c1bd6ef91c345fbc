"""The HTTP body and headers of one benchmark request (OpenAI completions or chat, always
streamed, usage requested in the final chunk).

Invariants: the body carries only what the config asks for (extras from --extra-body last, so
an operator can override anything); the API key goes only in Authorization; every request
has an `X-Request-Id` of the form `bench-<run>-<index>` so it can be found in server logs.
"""

from __future__ import annotations

from typing import Any

from bench.serve_config import ServeConfig
from bench.workloads import BenchRequest


def body(cfg: ServeConfig, req: BenchRequest, tier: str | None) -> dict[str, Any]:
    b: dict[str, Any] = {}
    if cfg.model:
        b["model"] = cfg.model
    if cfg.chat:
        b["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        b["prompt"] = req.prompt
    b["max_tokens"] = req.output_len
    b["stream"] = True
    b["stream_options"] = {"include_usage": True}
    if cfg.ignore_eos:
        b["ignore_eos"] = True  # vLLM/duet extension: the output is exactly max_tokens long
    if cfg.temperature is not None:
        b["temperature"] = cfg.temperature
    if tier and cfg.tier_via in ("body", "both"):
        b["service_tier"] = tier
    b.update(cfg.extra_body)
    return b


def headers(cfg: ServeConfig, key: str | None, tier: str | None, request_id: str) -> dict[str, str]:
    h = {"X-Request-Id": request_id}
    if key:
        h["Authorization"] = f"Bearer {key}"
    if tier and cfg.tier_via in ("header", "both"):
        h["x-duet-tier"] = tier
    return h

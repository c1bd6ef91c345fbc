"""A synthetic-latency OpenAI-compatible server: `/v1/completions` and `/v1/chat/completions`
streamed as OpenAI SSE with configured, deterministic timing and injectable failures. It is the
known reference `duet bench serve` is checked against (tests), and a quick target for trying the
bench without a model (`python -m bench.latency_server --port 8000`).

Timing: the first content chunk leaves `ttft_ms + ttft_ms_per_token × prompt tokens +
ttft_ms_per_running × requests in flight on arrival` after the request arrives, chunk k at
first + k × `itl_ms` (absolute deadlines, so sleeps do not drift).
A completion has `output_len` tokens (default: the request's max_tokens), `tokens_per_chunk`
per chunk, and a final usage chunk when the client asks (stream_options.include_usage) and
`usage` is on. Prompt tokens: the length of a token-id prompt, else whitespace-separated words.

Failures, by arrival number n (1, 2, ...), first match wins: `fail_every` → HTTP `fail_status`
with OpenAI's error body; `hang_every` → no answer for `hang_s`; `sse_error_every` → an error
event after the first chunk; `truncate_every` → the connection closes halfway through,
without [DONE]. `GET /stats` lists what arrived (time, path, auth, tier, lengths).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class LatencyConfig(msgspec.Struct, frozen=True, kw_only=True):
    ttft_ms: float = 50.0
    ttft_ms_per_token: float = 0.0
    #: queueing: extra TTFT per request already streaming when this one arrives
    ttft_ms_per_running: float = 0.0
    itl_ms: float = 10.0
    output_len: int | None = None
    tokens_per_chunk: int = 1
    usage: bool = True
    fail_every: int = 0
    fail_status: int = 500
    sse_error_every: int = 0
    truncate_every: int = 0
    hang_every: int = 0
    hang_s: float = 3600.0
    api_keys: tuple[str, ...] = ()
    model: str = "latency-model"


class _State:
    def __init__(self, config: LatencyConfig) -> None:
        self.config = config
        self.arrivals = 0
        self.log: list[dict[str, Any]] = []
        self.in_flight = 0
        self.registry = CollectorRegistry()
        self.running = Gauge(
            "duet:num_requests_running", "Requests streaming", registry=self.registry
        )
        self.requests = Counter("duet:requests", "Requests received", registry=self.registry)
        self.prompt_tokens = Counter(
            "duet:prompt_tokens", "Prompt tokens received", registry=self.registry
        )


STATE = web.AppKey("state", _State)


def _error(status: int, message: str, type_: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": None}}
    return web.json_response(body, status=status)


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("messages must be a non-empty list")
        return sum(len(str(m.get("content", "")).split()) for m in msgs if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, str) and prompt:
        return len(prompt.split())
    raise ValueError("prompt must be a non-empty string or list of token ids")


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


def _chunks(cfg: LatencyConfig, n_out: int) -> list[int]:
    full, rest = divmod(n_out, cfg.tokens_per_chunk)
    return [cfg.tokens_per_chunk] * full + ([rest] if rest else [])


async def _handle(request: web.Request, chat: bool) -> web.StreamResponse:
    arrived = time.perf_counter()
    st = request.app[STATE]
    cfg = st.config
    st.arrivals += 1
    n = st.arrivals
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        n_prompt = _prompt_tokens(body, chat)
        max_tokens = (
            body.get(
                "max_completion_tokens"
                if chat and "max_completion_tokens" in body
                else "max_tokens"
            )
            or 16
        )
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError("max_tokens must be a positive integer")
    except ValueError as e:
        return _error(400, str(e))
    st.log.append(
        {
            "n": n,
            "t": time.time(),
            "path": request.path,
            "authorization": request.headers.get("Authorization"),
            "tier": request.headers.get("x-duet-tier"),
            "service_tier": body.get("service_tier"),
            "model": body.get("model"),
            "max_tokens": max_tokens,
            "prompt_tokens": n_prompt,
            "ignore_eos": body.get("ignore_eos"),
            "request_id": request.headers.get("X-Request-Id"),
            "messages": len(body["messages"]) if chat else None,
        }
    )
    st.requests.inc()
    st.prompt_tokens.inc(n_prompt)
    if cfg.api_keys and request.headers.get("Authorization", "") not in {
        f"Bearer {k}" for k in cfg.api_keys
    }:
        return _error(401, "invalid API key", "authentication_error")
    if cfg.fail_every and n % cfg.fail_every == 0:
        return _error(cfg.fail_status, f"injected failure for request {n}", "server_error")
    if cfg.hang_every and n % cfg.hang_every == 0:
        await asyncio.sleep(cfg.hang_s)
        return _error(504, "hung on purpose")
    n_out = cfg.output_len or max_tokens
    ttft_ms = (
        cfg.ttft_ms + cfg.ttft_ms_per_token * n_prompt + cfg.ttft_ms_per_running * st.in_flight
    )
    usage = cfg.usage and bool((body.get("stream_options") or {}).get("include_usage"))
    st.running.inc()
    st.in_flight += 1
    try:
        if not body.get("stream"):
            await _sleep_until(
                arrived + (ttft_ms + cfg.itl_ms * (len(_chunks(cfg, n_out)) - 1)) / 1e3
            )
            text = "".join(f" t{i}" for i in range(n_out))
            choice = {
                "index": 0,
                "finish_reason": "length",
                **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
            }
            return web.json_response(
                {
                    "id": f"cmpl-{n}",
                    "model": cfg.model,
                    "choices": [choice],
                    "usage": _usage(n_prompt, n_out),
                }
            )
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        async for piece in _stream(cfg, n, chat, arrived + ttft_ms / 1e3, n_prompt, n_out, usage):
            if piece is None:  # truncation: drop the connection without [DONE]
                assert request.transport is not None
                request.transport.close()
                return resp
            await resp.write(piece)
        await resp.write_eof()
        return resp
    finally:
        st.running.dec()
        st.in_flight -= 1


async def _stream(
    cfg: LatencyConfig, n: int, chat: bool, first: float, n_prompt: int, n_out: int, usage: bool
) -> AsyncIterator[bytes | None]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None = None) -> bytes:
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {} if text is None else {"content": text},
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish}
        return _sse(
            {
                "id": f"cmpl-{n}",
                "object": obj,
                "created": int(time.time()),
                "model": cfg.model,
                "choices": [choice],
            }
        )

    if chat:  # OpenAI opens a chat stream with the role and empty content
        yield _sse(
            {
                "id": f"cmpl-{n}",
                "object": obj,
                "model": cfg.model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            }
        )
    pieces = _chunks(cfg, n_out)
    done = 0
    for k, size in enumerate(pieces):
        await _sleep_until(first + k * cfg.itl_ms / 1e3)
        if k == 1 and cfg.sse_error_every and n % cfg.sse_error_every == 0:
            yield _sse(
                {
                    "error": {
                        "message": f"injected stream error for request {n}",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                }
            )
            return
        if k == len(pieces) // 2 and k > 0 and cfg.truncate_every and n % cfg.truncate_every == 0:
            yield None
            return
        text = "".join(f" t{done + i}" for i in range(size))
        done += size
        yield chunk(text, "length" if k == len(pieces) - 1 else None)
    if usage:
        yield _sse(
            {
                "id": f"cmpl-{n}",
                "object": obj,
                "model": cfg.model,
                "choices": [],
                "usage": _usage(n_prompt, n_out),
            }
        )
    yield b"data: [DONE]\n\n"


def _usage(n_prompt: int, n_out: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def make_app(config: LatencyConfig) -> web.Application:
    if config.tokens_per_chunk < 1:
        raise ValueError("tokens_per_chunk must be at least 1")
    app = web.Application()
    app[STATE] = _State(config)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _handle(request, chat=False)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _handle(request, chat=True)

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": config.model, "object": "model"}]}
        )

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"arrivals": app[STATE].arrivals, "requests": app[STATE].log})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(app[STATE].registry), content_type="text/plain")

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.latency_server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    for name, field in zip(
        LatencyConfig.__struct_fields__, msgspec.structs.fields(LatencyConfig), strict=True
    ):
        flag = "--" + name.replace("_", "-")
        if name == "api_keys":
            p.add_argument(flag, default="", help="comma-separated keys to accept (default: any)")
        elif name == "usage":
            p.add_argument(
                "--no-usage", dest="usage", action="store_false", help="never send a usage chunk"
            )
        else:
            kind = {"model": str, "output_len": int}.get(name, type(field.default))
            p.add_argument(flag, type=kind, default=field.default, help=f"default: {field.default}")
    args = vars(p.parse_args(argv))
    host, port = args.pop("host"), args.pop("port")
    args["api_keys"] = tuple(k for k in args["api_keys"].split(",") if k)
    # a short shutdown: hung requests (hang_every) must not hold SIGTERM up for a minute
    web.run_app(
        make_app(LatencyConfig(**args)), host=host, port=port, print=None, shutdown_timeout=1.0
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

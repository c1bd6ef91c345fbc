"""`python -m bench.echo_node --port P`: a node that speaks the node API but computes nothing.

For measuring the gateway alone (bench.gateway): `POST /v1/completions` answers prefill legs
with vLLM-named `kv_transfer_params` and streams `max_tokens` tokens that echo the prompt's
ids (optionally `--token-delay` seconds apart, to hold many streams open at once), ending with
usage and `[DONE]` exactly like a real node; `/abort`, `/health` and `/metrics` answer too.
It is a load-test fixture, never a serving component.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
from typing import Any

import msgspec
from aiohttp import web

_ENC = msgspec.json.Encoder()
DELAY = web.AppKey("delay", float)
#: [streams open now, the most ever open at once] (served on /metrics)
OPEN = web.AppKey("open", list)
FIRST = web.AppKey("first", float)


def _chunk(rid: str, token: int, finish: str | None, usage: dict[str, Any] | None = None) -> bytes:
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": "echo",
        "choices": [
            {"index": 0, "text": f" t{token}", "finish_reason": finish, "token_ids": [token]}
        ],
    }
    if usage is not None:
        body["usage"] = usage
    return b"data: " + _ENC.encode(body) + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    body = msgspec.json.decode(await request.read())
    rid = request.headers.get("X-Request-Id", "echo")
    prompt = body.get("prompt") or [0]
    if isinstance(prompt, str):
        prompt = [ord(c) for c in prompt]
    n = int(body.get("max_tokens") or 16)
    usage = {
        "prompt_tokens": len(prompt),
        "completion_tokens": n,
        "total_tokens": len(prompt) + n,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    ktp = body.get("kv_transfer_params") or {}
    if ktp.get("do_remote_decode"):
        return web.json_response(
            {
                "id": rid,
                "choices": [
                    {"index": 0, "text": "", "token_ids": [prompt[0]], "finish_reason": "length"}
                ],
                "usage": usage,
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "remote_engine_id": "echo",
                    "remote_block_ids": [],
                    "remote_request_id": rid,
                    "remote_host": "127.0.0.1",
                    "remote_port": 0,
                },
            }
        )
    tokens = [prompt[i % len(prompt)] for i in range(n)]
    if not body.get("stream"):
        return web.json_response(
            {
                "id": rid,
                "choices": [
                    {
                        "index": 0,
                        "text": "".join(f" t{t}" for t in tokens),
                        "token_ids": tokens,
                        "finish_reason": "length",
                    }
                ],
                "usage": usage,
            }
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Request-Id": rid})
    stats = request.app[OPEN]
    stats[0] += 1
    stats[1] = max(stats[1], stats[0])
    try:
        return await _stream(request, resp, rid, tokens, usage)
    finally:
        stats[0] -= 1


async def _stream(
    request: web.Request,
    resp: web.StreamResponse,
    rid: str,
    tokens: list[int],
    usage: dict[str, Any],
) -> web.StreamResponse:
    n = len(tokens)
    await resp.prepare(request)
    if request.app[FIRST]:  # the engine's time to first token
        await asyncio.sleep(request.app[FIRST])
    delay = request.app[DELAY]
    for i, t in enumerate(tokens):
        last = i == n - 1
        await resp.write(_chunk(rid, t, "length" if last else None, usage if last else None))
        if delay and not last:
            await asyncio.sleep(delay)
    await resp.write_eof(b"data: [DONE]\n\n")  # and the body's end, in one send, as a node does
    return resp


async def ok(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "aborted": False})


async def metrics(r: web.Request) -> web.Response:
    """The streams open now and the most open at once (Prometheus' text format)."""
    now, most = r.app[OPEN]
    return web.Response(text=f"echo_streams_open {now}\necho_streams_open_max {most}\n")


def make_app(delay: float, first: float = 0.0) -> web.Application:
    app = web.Application()
    app[DELAY] = delay
    app[FIRST] = first
    app[OPEN] = [0, 0]
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/abort", ok)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", metrics)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.echo_node",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds between streamed tokens")
    p.add_argument(
        "--first-token-delay",
        type=float,
        default=0.0,
        help="seconds before the first streamed token (a node's time to first token)",
    )
    args = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # many streams at once
    web.run_app(
        make_app(args.token_delay, args.first_token_delay),
        host=args.host,
        port=args.port,
        access_log=None,
        backlog=4096,
        print=lambda *_: print(f"echo node ready on http://{args.host}:{args.port}", flush=True),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

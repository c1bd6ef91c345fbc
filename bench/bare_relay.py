"""`python -m bench.bare_relay --port P --node URL`: the cheapest HTTP relay Python can be.

bench.gateway's floor: it forwards a POST body unchanged to one node and pipes the answer's
bytes back as they arrive — no auth, quota, tokenizer, routing or accounting — on the same
stack as the gateway (aiohttp server and client, one session, uvloop). What the gateway adds
beyond this relay is what duet's own work costs; the relay's overhead over the node is what
any extra Python HTTP hop costs on this machine. A load-test fixture, never a serving component.
"""

from __future__ import annotations

import argparse
import resource
from collections.abc import AsyncIterator

import aiohttp
import uvloop
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
NODE = web.AppKey("node", str)


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    async with request.app[SESSION].post(
        request.app[NODE] + request.path, data=body, headers={"Content-Type": "application/json"}
    ) as r:
        resp = web.StreamResponse(
            status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "")}
        )
        await resp.prepare(request)
        async for data in r.content.iter_any():
            await resp.write(data)
    return resp


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def make_app(node: str) -> web.Application:
    app = web.Application()
    app[NODE] = node.rstrip("/")

    async def session(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/completions", relay)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bare_relay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--node", required=True, help="the node every request goes to")
    args = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    web.run_app(
        make_app(args.node),
        host=args.host,
        port=args.port,
        access_log=None,
        backlog=4096,
        loop=uvloop.new_event_loop(),
        print=lambda *_: print("bare relay ready", flush=True),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

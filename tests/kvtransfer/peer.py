"""A KV-pool owner process for the two-process tests (the "P" side).

    python -m tests.kvtransfer.peer --backend nixl --engine-id P1 --seed 1

It fills a host pool with the seeded pattern of `tests.kvtransfer.pools`, registers it
with the chosen backend and serves, on a free 127.0.0.1 port:
  GET /kv/metadata                 the transport metadata, as a node does
  GET /notifications?timeout=S     the next notification received (JSON), 504 on timeout
Then it prints `READY <port>` on stdout and runs until stdin closes (its parent died or
finished) or it gets SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import signal
import socket
import sys

import msgspec
from aiohttp import web

from kvtransfer import METADATA_CONTENT_TYPE, make_transport
from kvtransfer.base import Transport
from runtime.cluster_secret import ClusterSecret
from tests.kvtransfer.pools import TEST_LAYOUT, HostPool

TRANSPORT = web.AppKey("transport", Transport)


async def metadata(request: web.Request) -> web.Response:
    body = request.app[TRANSPORT].metadata_bytes()
    return web.Response(body=body, content_type=METADATA_CONTENT_TYPE)


async def notifications(request: web.Request) -> web.Response:
    timeout = float(request.query.get("timeout", "5"))
    try:
        note = await request.app[TRANSPORT].next_notification(timeout=timeout)
    except TimeoutError:
        raise web.HTTPGatewayTimeout() from None
    payload = {"engine_id": note.engine_id, "message": base64.b64encode(note.message).decode()}
    return web.json_response(payload)


async def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--layout", default="{}", help="JSON overrides of TEST_LAYOUT fields")
    ap.add_argument(
        "--secret", default=None, help="the cluster secret its handshake proves (tcp, ucx)"
    )
    args = ap.parse_args(argv)

    layout = msgspec.structs.replace(TEST_LAYOUT, **json.loads(args.layout))
    pool = HostPool(layout, args.seed)
    secret = {"secret": ClusterSecret(args.secret, "--secret")} if args.secret else {}
    transport = make_transport(args.backend, engine_id=args.engine_id, **secret)
    await transport.register_pool(pool.base, layout, "cpu")

    app = web.Application()
    app[TRANSPORT] = transport
    app.router.add_get("/kv/metadata", metadata)
    app.router.add_get("/notifications", notifications)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def watch_stdin() -> None:
        await reader.read()  # EOF: the test (or the test runner) is gone
        stop.set()

    watcher = loop.create_task(watch_stdin())
    print(f"READY {port}", flush=True)
    await stop.wait()
    watcher.cancel()
    await runner.cleanup()
    await transport.close()  # before `pool` (a local of this frame) can be freed
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))

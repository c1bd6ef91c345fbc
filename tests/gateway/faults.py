"""A fault injector for node-failure tests: an HTTP relay in front of a real node process that
SIGKILLs that node at a chosen stage of a request:

- `on_request`: when a completion request arrives, before the node sees it;
- `after_response`: once the node has answered a prefill leg (before the decode node pulls);
- `after_chunks`: after relaying exactly `chunks` SSE events of a stream, or before the event that
  finishes the answer if that comes first (always mid-stream).

With `node_dies=False` the node lives: the first stream is cut there (the connection closed as a
dead peer's would) and everything after it is relayed whole — a network cut, then a retry.

Everything else (abort, health, metrics) is relayed as is, so the gateway treats the relay as
the node. It runs on the test's own event loop.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import aiohttp
from aiohttp import web

from tests.procs import Proc

Mode = Literal["on_request", "after_response", "after_chunks"]


class KillRelay:
    def __init__(self, node: Proc, mode: Mode, chunks: int = 3, node_dies: bool = True) -> None:
        self.node = node
        self.mode = mode
        self.chunks = chunks
        self.node_dies = node_dies
        #: the fault happened (the node killed, or with `node_dies=False` the stream cut)
        self.killed = False
        #: completion requests relayed (the cut one included)
        self.completions = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> KillRelay:
        app = web.Application(client_max_size=2**26)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._session = aiohttp.ClientSession()
        return self

    async def stop(self) -> None:
        if self._session:
            await self._session.close()
        if self._runner:
            await self._runner.cleanup()

    def _kill(self) -> None:
        if not self.killed:
            self.killed = True
            if self.node_dies:
                self.node.kill()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        completion = request.path == "/v1/completions"
        self.completions += completion
        if completion and self.mode == "on_request":
            self._kill()
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("x-request-id", "content-type")
        }
        try:
            upstream = await self._session.request(
                request.method, self.node.url + request.path_qs, data=body, headers=headers
            )
        except aiohttp.ClientError:
            return web.Response(status=502, text="node unreachable")
        async with upstream:
            if not (
                completion
                and self.mode == "after_chunks"
                and not (self.killed and not self.node_dies)  # cut once: the rest pass
                and upstream.status == 200
                and upstream.headers.get("Content-Type", "").startswith("text/event-stream")
            ):
                data = await upstream.read()
                if completion and self.mode == "after_response" and b"do_remote_prefill" in data:
                    self._kill()
                return web.Response(
                    status=upstream.status, body=data, content_type=upstream.content_type
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            sent = 0
            with contextlib.suppress(aiohttp.ClientError):
                async for line in upstream.content:
                    if line.startswith(b"data: ") and b'"finish_reason":"' in line:
                        # the answer's last event: kill before it, so the stream is cut mid-answer
                        # however the node grouped its tokens (a fast node sends a short answer
                        # in fewer events than `chunks`)
                        self._kill()
                        break
                    await resp.write(line)
                    if line.startswith(b"data: "):
                        sent += 1
                        if sent == self.chunks:
                            self._kill()
                            break  # exactly `chunks`: not what the dead node's socket still held
            # the node is gone: cut the stream like a dead peer would (no [DONE])
            assert request.transport is not None
            request.transport.close()
            return resp

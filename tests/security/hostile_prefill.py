"""A hostile "prefill node" for tests/security/test_kv_peers.py (run as a process):

    python -m tests.security.hostile_prefill HOST PORT DECODE_URL TRANSPORT_HOST TRANSPORT_PORT

It listens on HOST:PORT (an address inside the decode node's allowed networks) and speaks just
enough of the node API: `/health`, `/kv/release` (200), and `/kv/metadata`, which copies the
decode node's own KV layout (so the layout check passes) but names engine `evil-prefill` and
points the KV transport at TRANSPORT_HOST:TRANSPORT_PORT — any address the attacker chose.
"""

from __future__ import annotations

import json
import sys
import urllib.request

from aiohttp import web

ENGINE_ID = "evil-prefill"


def main() -> None:
    host, port, decode_url, t_host, t_port = sys.argv[1:6]
    with urllib.request.urlopen(decode_url + "/kv/metadata", timeout=10) as r:
        meta = json.loads(r.read())
    meta.update(engine_id=ENGINE_ID, host=t_host, port=int(t_port))
    body = json.dumps(meta).encode()

    async def metadata(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/kv/metadata", metadata)
    app.router.add_post("/kv/release", ok)
    web.run_app(app, host=host, port=int(port), print=None)


if __name__ == "__main__":
    main()

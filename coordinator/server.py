"""Running a coordinator replica: serve until SIGTERM/SIGINT, then resign and exit 0.

The "ready" line on stdout is printed once the port accepts requests. On shutdown the replica
revokes its etcd lease, so if it led, another replica takes over at once instead of after
the TTL.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web

from coordinator.app import make_app
from coordinator.service import CoordinatorConfig

log = logging.getLogger("duet.coordinator")


async def serve(cfg: CoordinatorConfig) -> int:
    app = make_app(cfg)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        print(f"duet coordinator: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"duet coordinator ready on http://{cfg.host}:{cfg.port} replica_id={cfg.resolved_replica_id} "
          f"cluster={cfg.cluster} etcd={cfg.etcd}", flush=True)  # fmt: skip
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()
    log.info("stopped")
    return 0


def run_coordinator(cfg: CoordinatorConfig) -> int:
    return asyncio.run(serve(cfg))

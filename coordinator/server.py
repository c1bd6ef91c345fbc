"""Running a coordinator replica: serve until SIGTERM/SIGINT, then resign and exit 0.

The "ready" line on stdout is printed once the port accepts requests. On shutdown the replica
revokes its etcd lease, so if it led, another replica takes over at once instead of after
the TTL.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from aiohttp import web

from coordinator.app import Background, make_app
from coordinator.service import CoordinatorConfig
from runtime.read_deadlines import DeadlineAppRunner

log = logging.getLogger("duet.coordinator")
#: seconds shutdown may take before the process exits regardless
SHUTDOWN_GRACE_S = 15.0


async def serve(cfg: CoordinatorConfig, background: Sequence[Background] = ()) -> int:
    from runtime.cluster_secret import SecretError

    try:
        cfg.security.check_start([cfg.host], "this coordinator")
    except SecretError as e:
        print(f"duet coordinator: {e}", file=sys.stderr)
        return 2
    app = make_app(cfg, background=background)
    # HTTP parser errors answered in the same error body as /route's own (runtime.http_errors);
    # deadlines for reading each request's headers and body (runtime.read_deadlines).
    runner = DeadlineAppRunner(
        app, deadlines=cfg.deadlines, handler_cancellation=True, access_log=None
    )
    await runner.setup()
    tls = cfg.security.server_ssl()
    site = web.TCPSite(runner, cfg.host, cfg.port, ssl_context=tls)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        print(f"duet coordinator: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr)
        return 1
    _renewals = cfg.security.renewals(tls)  # held: the task runs while this serves
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"duet coordinator ready on {cfg.security.own_scheme}://{cfg.host}:{cfg.port} "
        f"replica_id={cfg.resolved_replica_id} cluster={cfg.cluster} etcd={cfg.etcd}",
        flush=True,
    )
    await stop.wait()
    log.info("shutting down")
    # Shutdown must end even if a dependency hangs (an unreachable etcd): exit anyway after a
    # bound; the lease then expires on its own within the TTL.
    watchdog = threading.Timer(SHUTDOWN_GRACE_S, _force_exit)
    watchdog.daemon = True
    watchdog.start()
    await runner.cleanup()
    watchdog.cancel()
    log.info("stopped")
    return 0


def _force_exit() -> None:
    log.warning(
        "shutdown did not finish within %.0f s (etcd unreachable?); exiting anyway",
        SHUTDOWN_GRACE_S,
    )
    logging.shutdown()
    os._exit(0)


def run_coordinator(cfg: CoordinatorConfig, background: Sequence[Background] = ()) -> int:
    return asyncio.run(serve(cfg, background))

"""Running the gateway process: serve until SIGTERM/SIGINT, then stop taking requests, let
in-flight ones finish (bounded), flush usage records and exit 0.

With `[server] reuse_port` several gateway processes listen on one port (SO_REUSEPORT: the
kernel spreads connections, and a dead process's listener leaves the group with it); each may
also listen on its own `instance_port` (loopback), where a supervisor checks that very process.

The "ready" line on stdout is printed only once the port accepts requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import signal
import sys

import uvloop
from aiohttp import web

from gateway.accounts.store.dsn import redact, scrub
from gateway.app import make_app
from gateway.config import ConfigError, GatewayConfig
from gateway.conn_limits import LimitedAppRunner

log = logging.getLogger("duet.gateway")


#: descriptors beyond two per running request: the store, listeners, idle keep-alive sockets
_FD_SPARE = 4096


def _raise_fd_limit(max_inflight: int) -> None:
    """Every running request holds two sockets (client and node), and waiting clients hold
    theirs: raise the soft limit to the hard one, and the hard one too where this process may;
    say so once at start-up when the limit cannot carry `[tiers] max_inflight` (past it a request
    is shed with 503, and no node is blamed)."""
    need = 2 * max_inflight + _FD_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    short = hard != resource.RLIM_INFINITY and hard < need
    if short:
        with contextlib.suppress(ValueError, OSError):  # raising the hard limit needs privilege
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
            return
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if short:
        log.warning(
            "this process may open %d files; [tiers] max_inflight = %d needs about %d (two sockets "
            "per request): requests past the limit are shed with 503. Raise `ulimit -n` or lower "
            "max_inflight.",
            hard,
            max_inflight,
            need,
        )


async def serve(cfg: GatewayConfig, grace_s: float = 30.0) -> int:
    _raise_fd_limit(cfg.tiers.max_inflight)
    if cfg.security.secret is None and any(m.kind == "cluster" for m in cfg.models.values()):
        # The gateway's own API has its keys; it is the nodes and coordinators that need the
        # secret, and this gateway cannot reach them once they require it.
        log.warning(
            "no cluster secret (--cluster-secret-file, $DUET_CLUSTER_SECRET_FILE or "
            "$DUET_CLUSTER_SECRET): nodes and coordinators that require one will answer this "
            "gateway 401"
        )
    try:
        app = make_app(cfg)
    except ConfigError as e:
        print(f"duet gateway: cannot start: {e}", file=sys.stderr)
        return 2
    srv = cfg.server
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # request on every node it touched.
    # AppRunner from runtime.http_errors: what aiohttp's HTTP parser refuses (a header over
    # max_header_bytes, a malformed request line) is answered in OpenAI's error body too.
    # LimitedAppRunner: connections per client address; deadlines for each request's headers
    # and body (runtime/read_deadlines.py).
    runner = LimitedAppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        max_line_size=srv.max_header_bytes,
        max_field_size=srv.max_header_bytes,
        shutdown_timeout=grace_s,
        keepalive_timeout=srv.keepalive_timeout_s,
        max_connections_per_address=srv.max_connections_per_address,
        deadlines=srv.read_deadlines(),
    )
    try:
        await runner.setup()  # opens the store, loads tokenizers
    except Exception as e:  # an unreachable database, a broken tokenizer: one line, not a traceback
        print(
            f"duet gateway: cannot start (store {redact(cfg.store_url)}): {type(e).__name__}: "
            f"{scrub(str(e), cfg.store_url)}",
            file=sys.stderr,
        )
        await runner.cleanup()
        return 1
    ssl = cfg.security.server_ssl()
    # reuse_port: N gateways share the public port (duet up --gateways N); the kernel gives each
    # new connection to one of them, and a dead one's share to the survivors at once
    site = web.TCPSite(
        runner, srv.host, srv.port, backlog=4096, ssl_context=ssl, reuse_port=srv.reuse_port or None
    )
    await site.start()
    if srv.instance_port is not None:  # this process alone: for its supervisor's health check
        await web.TCPSite(runner, "127.0.0.1", srv.instance_port, ssl_context=ssl).start()
    # what start-up made (modules, config, tables) lives as long as the process: kept out of
    # the collector's sight, a full collection walks only what requests made
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        "duet gateway ready on "
        f"{'https' if cfg.security.tls_cert else 'http'}://{srv.host}:{srv.port} "
        f"models={','.join(sorted(cfg.models))} store={redact(cfg.store_url)}",
        flush=True,
    )
    await stop.wait()
    await runner.cleanup()
    return 0


def run_gateway(cfg: GatewayConfig) -> int:
    try:
        # uvloop: the gateway is a relay, and the event loop's own cost per read and write is
        # most of what a relay adds (bench.gateway: overhead p50 and p99 both drop with it)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(serve(cfg))
    except OSError as e:
        print(
            f"duet gateway: cannot listen on {cfg.server.host}:{cfg.server.port}: {e}",
            file=sys.stderr,
        )
        return 1

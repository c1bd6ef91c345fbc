"""Running a node process: build the engine and transport, serve, and shut down gracefully.

SIGTERM/SIGINT: stop taking new requests (503 with a clear body), give in-flight requests
and KV held for decode nodes `grace_period_s` seconds to finish or be pulled, abort the rest, free
held blocks, close the transport and exit 0. If the engine dies the node exits 1 at once (its
streams already ended with an error), so a supervisor restarts it: never half alive. The "ready"
line on stdout is printed only once the port accepts requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable, Sequence

from aiohttp import web

from node import kv_network
from node.app import make_app
from node.config import NodeConfig, parse_cpus
from node.engines import make_engine
from node.legs import Roles
from node.lora import adapter_names
from node.metrics import NodeMetrics
from node.model_server_metrics import ModelServerCollector
from node.state import NodeState
from runtime.read_deadlines import DeadlineAppRunner
from text.guide_compile import GuideChecker

log = logging.getLogger("duet.node")


def build_state(cfg: NodeConfig, register: Sequence[Callable[[Roles], object]] = ()) -> NodeState:
    """The node's state with its engine (built, not started), transport and the roles
    `register` adds (the composition root passes prefill.register / decode.register)."""
    if cfg.cpus:
        # Before torch starts its thread pool, so the threads inherit the mask.
        os.sched_setaffinity(0, parse_cpus(cfg.cpus))
    engine = make_engine(cfg.engine_kind, cfg.engine)
    node_id = cfg.resolved_node_id
    # A new engine id per process: a restarted node's pool holds nothing a peer cached.
    engine_id = f"{node_id}-{uuid.uuid4().hex[:8]}"
    from kvtransfer import KVTransferMetrics, make_transport

    pool = (engine.kv_layout.block_size, engine.kv_layout.num_blocks, engine.kv_layout.dtype)
    served = ModelServerCollector(
        engine.stats, engine.model_name, pool, lambda: adapter_names(engine)
    )
    metrics = NodeMetrics(engine.stats, engine.model_name, cfg.role, served)
    # The tcp backend (and nixl's fallback to it) listens beside the HTTP port and requires the
    # cluster secret in its handshake.
    listen = (
        {"host": cfg.host, "advertise_host": cfg.public_host, "secret": cfg.security.secret}
        if cfg.transport in ("tcp", "nixl")
        else {}
    )
    if cfg.transport == "ucx":
        listen = {"host": cfg.host, "secret": cfg.security.secret}
    transport = None
    if cfg.task == "embed":
        log.info("KV transport: none (an embedding node keeps no KV past a request)")
    elif getattr(engine, "handles_kv_transfer", False):
        log.info("KV transport: the %s engine's own", cfg.engine_kind)
        kv_network.log_startup("nixl", cfg.kv_network_isolated)  # vLLM's NixlConnector
    else:
        transport = make_transport(
            cfg.transport,
            engine_id=engine_id,
            timeout=cfg.transfer_timeout_s,
            metrics=KVTransferMetrics(metrics.registry),
            **listen,
        )
        log.info("KV transport: %s", transport.backend)
        kv_network.log_startup(transport.backend, cfg.kv_network_isolated)
    roles = Roles()
    for reg in register:
        reg(roles)
    from runtime.tracing import NODE_RING, from_env, setup

    guides = GuideChecker(
        cfg.guide_compile_timeout_s,
        cfg.guide_compile_threads,
        on_compile=metrics.guide_compiled,
        running=metrics.guides_compiling,
    )
    return NodeState(
        config=cfg,
        engine=engine,
        metrics=metrics,
        node_id=node_id,
        engine_id=engine_id,
        transport=transport,
        roles=roles,
        tracing=setup(f"duet-{cfg.role}", from_env(NODE_RING)),
        guides=guides,
    )


#: A gateway opens up to `[routing] max_connections_per_node` (1024) connections to a node at
#: once when a burst meets a cold pool; with the default accept queue of 128 the SYNs past it
#: are dropped and wait out a retransmit (1 s, then 3 s) — a connect timeout on a node that
#: is perfectly well. (The kernel caps it at net.core.somaxconn.)
LISTEN_BACKLOG = 4096


async def serve(state: NodeState) -> int:
    cfg = state.config
    app = make_app(state)
    # HTTP parser errors answered in OpenAI's error body too (runtime.http_errors); deadlines for
    # reading each request's headers and body (runtime.read_deadlines).
    runner = DeadlineAppRunner(
        app, deadlines=cfg.deadlines, handler_cancellation=True, access_log=None
    )
    await runner.setup()
    tls = cfg.security.server_ssl()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=LISTEN_BACKLOG, ssl_context=tls)
    await site.start()
    _renewals = cfg.security.renewals(tls)  # held: the task runs while this serves
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, state.shutdown.set)
    print(
        f"duet {cfg.role if cfg.task == 'generate' else 'embed'} node ready on "
        f"{cfg.security.own_scheme}://{cfg.host}:{cfg.port} node_id={state.node_id} "
        f"engine_id={state.engine_id} model={state.engine.model_name}",
        flush=True,
    )
    await state.shutdown.wait()
    state.draining = True
    if state.engine.dead is None:
        log.info(
            "shutting down: draining %d in-flight request(s), grace %.0fs",
            state.inflight,
            cfg.grace_period_s,
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(cfg.grace_period_s):
                await _quiet(state)
        for erid in list(state.active):
            log.info("grace period over: aborting %s", erid)
            await state.engine.abort(erid)
    await runner.cleanup()
    state.guides.close()
    await asyncio.to_thread(state.tracing.shutdown)  # flushes the spans still queued for export
    log.info("stopped (exit code %d)", state.exit_code)
    return state.exit_code


async def _quiet(state: NodeState) -> None:
    """No request in flight and no KV held for a decode node (a P stopped while D has not pulled
    yet would make D recompute the prompt): what the grace period waits for."""
    while True:
        await state.idle.wait()
        if state.inflight == 0 and not state.engine.stats().get("num_requests_held", 0):
            return
        await asyncio.sleep(0.1)  # holds end on the engine thread: polled, as registration does


def run_node(cfg: NodeConfig, register: Sequence[Callable[[Roles], object]] = ()) -> int:
    from runtime.cluster_secret import SecretError

    try:
        cfg.security.check_start([cfg.host], f"this {cfg.role} node")  # before the engine loads
    except SecretError as e:
        print(f"duet {cfg.role}: {e}", file=sys.stderr)
        return 2
    state = build_state(cfg, register)
    try:
        return asyncio.run(serve(state))
    except OSError as e:
        print(f"duet {cfg.role}: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr)
        return 1

"""The gateway's connections to one node are bounded (`[routing] max_connections_per_node`):
more concurrent requests wait for a connection — the wait is not a connect timeout — and all
succeed, while the node never sees more streams at once than the bound. Running out of file
descriptors is the gateway's own overload (503 `overloaded`), never a node's failure."""

from __future__ import annotations

import asyncio
import errno
import sys
import urllib.request
from pathlib import Path

import aiohttp
from aiohttp.client_reqrep import ConnectionKey

from gateway.backends.node_client import NodeFailure, _local_exhaustion, _unreachable
from gateway.serving.tiers import Shed
from tests.gateway.helpers import MODEL, gateway_proc, make_team
from tests.procs import Proc, free_port, running


def _echo(tmp: Path, delay: float) -> Proc:
    port = free_port()
    return Proc(
        [sys.executable, "-m", "bench.echo_node", "--port", str(port), "--token-delay", str(delay)],
        port,
        tmp / f"echo-{port}.log",
    )


def _open_max(node: Proc) -> int:
    text = urllib.request.urlopen(node.url + "/metrics", timeout=5).read().decode()
    return int(
        next(ln.split()[1] for ln in text.splitlines() if ln.startswith("echo_streams_open_max "))
    )


async def test_requests_beyond_the_bound_wait_for_a_connection(
    tmp_path: Path, tiny_llama: Path
) -> None:
    node = _echo(tmp_path, 0.05)  # 8 tokens, 50 ms apart: streams overlap
    model = {"kind": "cluster", "tokenizer": str(tiny_llama), "static": {"both": [node.url]}}
    # connect_timeout_s far below the wait for a free connection: the wait must not count as one
    g = gateway_proc(
        tmp_path, {MODEL: model}, routing={"max_connections_per_node": 2, "connect_timeout_s": 0.2}
    )
    with running(node, g):
        key = make_team(g.url, "t")
        body = {"model": MODEL, "prompt": "wait your turn", "max_tokens": 8, "stream": True}

        async def one(s: aiohttp.ClientSession) -> int:
            async with s.post(
                g.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as r:
                data = await r.read()
                assert r.status == 200, data
                return data.count(b'"text"')

        async with aiohttp.ClientSession() as s:
            counts = await asyncio.gather(*[one(s) for _ in range(8)])
        assert counts == [8] * 8
        assert _open_max(node) == 2, "the node saw more streams at once than the gateway's bound"


def test_out_of_descriptors_is_the_gateways_overload_not_the_nodes_failure() -> None:
    key = ConnectionKey("127.0.0.1", 1, False, True, None, None, None, None)
    emfile = aiohttp.ClientConnectorError(key, OSError(errno.EMFILE, "Too many open files"))
    refused = aiohttp.ClientConnectorError(key, OSError(errno.ECONNREFUSED, "Connection refused"))
    assert _local_exhaustion(emfile) and _local_exhaustion(
        OSError(errno.ENFILE, "file table overflow")
    )
    assert not _local_exhaustion(refused) and not _local_exhaustion(TimeoutError())
    shed = _unreachable("http://n", emfile)
    assert (
        isinstance(shed, Shed)
        and shed.status == 503
        and shed.code == "overloaded"
        and shed.retry_after_s > 0
    )
    assert isinstance(_unreachable("http://n", refused), NodeFailure)


async def test_a_refused_connect_does_not_leave_the_node_out() -> None:
    """A refused connect (the process is gone, its host answers) is a node failure, but not
    the silence that leaves a node out of this gateway's routing for a while: a node restarted
    on its port must be used again as soon as it is registered (the duet up restart test saw
    its requests prefilled elsewhere for the exclusion's 10 s)."""
    url = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as s:
        try:
            await s.get(url + "/health")
        except aiohttp.ClientConnectorError as e:
            refused: BaseException = e
        else:
            raise AssertionError("something listens on a free port")
    failure = _unreachable(url, refused)
    assert isinstance(failure, NodeFailure) and not failure.unreachable
    assert _unreachable(url, TimeoutError()).unreachable  # a silent node still is

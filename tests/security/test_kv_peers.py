"""A decode node reads KV only from where its operator allows.

The attack: anyone who reaches a decode node's port names, in `kv_transfer_params`, a "prefill"
inside the allowed networks: a server of their own (here on 127.0.0.2) that answers
`/kv/metadata` with the decode node's own layout but its KV transport pointed at another address
(127.0.0.3, where the attacker serves poisoned blocks). The decode node used to connect there —
`--allowed-peers` checked the HTTP address only — and the blocks it read entered its prefix
cache, where every tenant's prompt with that prefix decoded over them.

Now the transport address a peer publishes must lie in the allowed networks and be the host the
leg named, and a node with a cluster (etcd) pulls only from registered prefill nodes at their
registered address. Either way the refusal is a 403 before any byte moves: the attacker's
transport listener sees no connection, no KV byte is read, and nothing enters the prefix cache.

Real parts: decode nodes (tiny model, tcp transport; one registered in a real etcd), the hostile
prefill as its own process on a second loopback address, a real socket as the attacker's
transport.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from prometheus_client import CollectorRegistry

from coordinator.etcd_server import EtcdServer
from kvtransfer import (
    KVTransferMetrics,
    PeerError,
    decode_metadata,
    make_transport,
    unavailable_reason,
)
from runtime.strict import strict_mode
from tests.gateway.helpers import metric
from tests.kvtransfer.pools import TEST_LAYOUT, HostPool, assert_blocks
from tests.kvtransfer.procs import PeerProcess
from tests.procs import Proc, duet_node, free_port, running
from tests.security.hostile_prefill import ENGINE_ID
from tests.wait import wait_for

NODE_ARGS = (
    "--dtype",
    "float32",
    "--kv-blocks",
    "64",
    "--max-model-len",
    "256",
    "--transport",
    "tcp",
    "--transfer-timeout",
    "2",
)
HOSTILE = "127.0.0.2"
ELSEWHERE = "127.0.0.3"
#: 40 prompt tokens: 3 blocks of 16
PROMPT = list(range(10, 50))


@contextlib.contextmanager
def listener(host: str) -> Iterator[socket.socket]:
    """The attacker's KV transport: a listening socket that records whoever connects."""
    sock = socket.create_server((host, 0))
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


def connections(sock: socket.socket) -> int:
    n = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


@contextlib.contextmanager
def hostile_prefill(decode: Proc, transport: socket.socket, tmp: Path) -> Iterator[int]:
    """The hostile "prefill" process on HOSTILE; yields its HTTP port."""
    port = free_port()
    t_host, t_port = transport.getsockname()[:2]
    with (tmp / f"hostile-{port}.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.security.hostile_prefill",
                HOSTILE,
                str(port),
                decode.url,
                t_host,
                str(t_port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(
                lambda: _up(f"http://{HOSTILE}:{port}/health") or proc.poll() is not None,
                what="the hostile prefill",
            )
            assert proc.poll() is None, (tmp / f"hostile-{port}.log").read_text()
            yield port
        finally:
            proc.terminate()
            proc.wait(10)


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def decode_leg(decode: Proc, prefill_port: int) -> tuple[int, dict[str, Any]]:
    kv = {
        "do_remote_prefill": True,
        "remote_engine_id": ENGINE_ID,
        "remote_block_ids": [0, 1, 2],
        "remote_request_id": "victim-prefix",
        "remote_host": HOSTILE,
        "remote_port": prefill_port,
        "remote_num_tokens": len(PROMPT),
    }
    return post(
        decode.url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "kv_transfer_params": kv},
    )


def assert_refused_before_any_byte(
    decode: Proc, status: int, body: dict[str, Any], transport: socket.socket, why: str
) -> None:
    assert status == 403, body
    assert body["error"]["code"] == "peer_not_allowed" and why in body["error"]["message"], body
    assert connections(transport) == 0
    assert metric(decode.url, "duet:kv_transfer_bytes_total") == 0
    # Nothing entered the prefix cache: the same prompt, computed here, finds nothing cached.
    status, plain = post(
        decode.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    )
    assert status == 200 and plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, plain


@pytest.fixture(scope="module")
def standalone(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, Path]]:
    tmp = tmp_path_factory.mktemp("kv-peers")
    with running(duet_node("decode", str(tiny_llama), tmp, *NODE_ARGS)) as (d,):
        yield d, tmp


def test_a_transport_address_off_the_named_host_is_refused(standalone: tuple[Proc, Path]) -> None:
    decode, tmp = standalone
    with listener(ELSEWHERE) as transport, hostile_prefill(decode, transport, tmp) as port:
        status, body = decode_leg(decode, port)
        assert_refused_before_any_byte(
            decode, status, body, transport, "is not the host it was named by"
        )


def test_a_transport_address_outside_the_allowed_networks_is_refused(
    tiny_llama: Path, tmp_path: Path
) -> None:
    # The operator allows only 127.0.0.2/32: the named host is allowed, its transport (127.0.0.3)
    # not.
    d = duet_node(
        "decode", str(tiny_llama), tmp_path, *NODE_ARGS, "--allowed-peers", f"{HOSTILE}/32"
    )
    with (
        running(d),
        listener(ELSEWHERE) as transport,
        hostile_prefill(d, transport, tmp_path) as port,
    ):
        status, body = decode_leg(d, port)
        assert_refused_before_any_byte(
            d, status, body, transport, "outside this node's allowed peer networks"
        )


def test_with_a_cluster_an_unregistered_prefill_node_is_never_contacted(
    tiny_llama: Path, tmp_path: Path
) -> None:
    # The transport is on the named host itself: only the cluster's membership can tell.
    with EtcdServer(tmp_path / "etcd") as etcd:
        d = duet_node(
            "decode",
            str(tiny_llama),
            tmp_path,
            *NODE_ARGS,
            "--etcd",
            etcd.url,
            "--node-id",
            "decode-0",
        )
        with (
            running(d),
            listener(HOSTILE) as transport,
            hostile_prefill(d, transport, tmp_path) as port,
        ):
            # (a 503 until the node has listed the registrations once)
            status, body = wait_for(
                lambda: (r := decode_leg(d, port))[0] != 503 and r, what="a listed cluster"
            )
            # Not contacted, not even to release; the prompt prefilled here instead (this
            # node's view of etcd may lag the coordinator's: the request is not at fault)
            assert status == 200, body
            assert connections(transport) == 0
            assert metric(d.url, "duet:kv_transfer_bytes_total") == 0
            plain_status, plain = post(
                d.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
            )
            assert plain_status == 200 and plain["choices"][0]["text"] == body["choices"][0]["text"]
            assert "not a registered prefill node" in d.log()


async def test_a_nixl_agent_must_be_the_engine_the_leg_named() -> None:
    """NIXL's agent metadata is opaque (a UCX worker address and memory keys), so its transport
    address cannot be checked against --allowed-peers; what is checked is who it is: the agent
    a peer publishes must be named as the engine the leg named. A peer that answers for engine
    "P-claimed" with the agent of "P-real" (its own, or one it copied) is refused before any
    read, and the agent is forgotten: the real engine is then read from as usual.

    Real parts: a NIXL owner process (tests/kvtransfer/peer.py) and a NIXL reader here."""
    if (reason := unavailable_reason("nixl")) is not None:
        (pytest.fail if strict_mode() else pytest.skip)(reason)  # CI must not pass on a skip
    owner = PeerProcess("nixl", "P-real", 1)
    pool = HostPool(TEST_LAYOUT, 2)
    try:
        async with aiohttp.ClientSession() as http, http.get(owner.url("/kv/metadata")) as r:
            md = decode_metadata(await r.read())
        async with make_transport(
            "nixl", engine_id="D-nixl", timeout=10, metrics=KVTransferMetrics(CollectorRegistry())
        ) as reader:
            await reader.register_pool(pool.base, TEST_LAYOUT)
            with pytest.raises(PeerError, match="published a NIXL agent named 'P-real'"):
                await reader.add_peer(msgspec.structs.replace(md, engine_id="P-claimed"))
            assert reader.peers == {} and reader.metrics.bytes == 0
            peer = await reader.add_peer(md)
            await reader.read(peer, [3], [1], timeout=10)
            assert_blocks(pool, [1], 1, [3])
    finally:
        owner.stop()

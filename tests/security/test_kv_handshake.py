"""The tcp KV transport's handshake proves the cluster secret, both ways (the internal
plane is authenticated, the transport's handshake included).

The attack: anyone who reaches a prefill node's KV port could read any block of its pool (a
`ReadRequest` names block ids, nothing else), and a decode node reads from whatever listener a
metadata names. Now every connection opens with an HMAC challenge-response over the secret
(kvtransfer/tcp_transport.py): a reader without the secret gets no byte of the pool, and a
reader does not take bytes from an owner that cannot prove the secret.

Real parts: two tcp transports with real pools and sockets, and a raw socket speaking the wire
format as an attacker would.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvtransfer import (
    KVTransferMetrics,
    PeerError,
    Transport,
    TransportMetadata,
    decode_metadata,
    make_transport,
    unavailable_reason,
    wire,
)
from kvtransfer.ucx_transport import import_ucxx
from runtime.cluster_secret import ClusterSecret, write_secret_file
from runtime.strict import strict_mode
from tests.kvtransfer.pools import TEST_LAYOUT, HostPool, block_words
from tests.kvtransfer.procs import PeerProcess
from tests.procs import TINY_NODE_ARGS, Proc, duet_node, running
from tests.test_ci_strict import _no_nixl
from tests.wait import wait_for

A_VALUE = secrets.token_urlsafe(32)
A = ClusterSecret(A_VALUE, "test A")
B = ClusterSecret(secrets.token_urlsafe(32), "test B")


async def _read(
    owner_secret: ClusterSecret | None, reader_secret: ClusterSecret | None
) -> tuple[bool, int]:
    """(whether the reader got block 3 right, handshakes the owner refused)."""
    owner_pool, reader_pool = HostPool(TEST_LAYOUT, 1), HostPool(TEST_LAYOUT, 2)
    async with (
        make_transport("tcp", engine_id="P", secret=owner_secret) as owner,
        make_transport("tcp", engine_id="D", secret=reader_secret) as reader,
    ):
        await owner.register_pool(owner_pool.base, TEST_LAYOUT)
        await reader.register_pool(reader_pool.base, TEST_LAYOUT)
        try:
            peer = await reader.add_peer(owner.metadata())
            await reader.read(peer, [3], [5])
        except PeerError:
            return False, owner.refused_handshakes
        return bool(
            np.array_equal(reader_pool.blocks[5], block_words(TEST_LAYOUT, 1, 3))
        ), owner.refused_handshakes


async def test_readers_with_the_secret_read() -> None:
    assert await _read(A, A) == (True, 0)
    assert await _read(None, None) == (True, 0)  # a dev cluster without a secret still works


@pytest.mark.parametrize(
    ("owner", "reader"), [(A, B), (A, None), (None, A)], ids=["other", "none", "owner-none"]
)
async def test_a_reader_with_another_secret_reads_nothing(
    owner: ClusterSecret | None, reader: ClusterSecret | None
) -> None:
    ok, refused = await _read(owner, reader)
    assert not ok
    assert refused == 1  # the owner saw it and closed the connection


async def test_a_raw_read_request_without_the_handshake_gets_no_block() -> None:
    """An attacker's socket that skips the handshake and asks for blocks at once."""
    pool = HostPool(TEST_LAYOUT, 7)
    async with make_transport("tcp", engine_id="P", secret=A) as owner:
        await owner.register_pool(pool.base, TEST_LAYOUT)
        md = owner.metadata()
        got = await asyncio.to_thread(_raw_read, md.host, md.port)
        # the owner's challenge, then nothing: no Reply, no block byte
        msg = wire.decode(got[wire.FRAME_HEADER.size :])
        assert isinstance(msg, wire.Challenge)
        assert len(got) == wire.FRAME_HEADER.size + len(wire.encode(msg))
        assert owner.refused_handshakes == 1


def _raw_read(host: str, port: int) -> bytes:
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(wire.frame(wire.ReadRequest(req_id=1, blocks=[0, 1, 2])))
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
        return data


async def test_refused_handshakes_cannot_flood_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """Anyone who reaches the KV port could write one warning per connection; now one per 10 s."""
    pool = HostPool(TEST_LAYOUT, 7)
    async with make_transport("tcp", engine_id="P", secret=A) as owner:
        await owner.register_pool(pool.base, TEST_LAYOUT)
        md = owner.metadata()
        with caplog.at_level("WARNING"):
            for _ in range(20):
                await asyncio.to_thread(_raw_read, md.host, md.port)
        assert owner.refused_handshakes == 20
        lines = [r for r in caplog.records if "refused a KV reader" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]


async def _node_metadata(node: Proc, secret: str) -> TransportMetadata:
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {secret}"}) as s,
        s.get(node.url + "/kv/metadata") as r,
    ):
        assert r.status == 200, await r.text()
        return decode_metadata(await r.read())


async def _reads(md: TransportMetadata, secret: ClusterSecret | None) -> bool:
    """Whether a tcp reader with `secret` reads block 0 of the node's pool."""
    pool = HostPool(md.layout, 3)
    async with make_transport(
        "tcp", engine_id=f"D-{secrets.token_hex(4)}", secret=secret, timeout=10
    ) as reader:
        await reader.register_pool(pool.base, md.layout)
        try:
            peer = await reader.add_peer(md)
            await reader.read(peer, [0], [0])
        except PeerError:
            return False
        return True


async def test_a_node_whose_nixl_falls_back_to_tcp_requires_the_secret(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node on the default `--transport nixl` whose NIXL cannot load serves its pool over tcp
    (outside CI=true). That fallback was built without the node's secret: an empty key, so a
    reader with no secret at all read the pool of a node that had one."""
    monkeypatch.delenv("CI", raising=False)  # strict mode refuses the fallback; this test wants it
    monkeypatch.delenv("DUET_STRICT", raising=False)
    secret_file = tmp_path / "cluster.secret"
    write_secret_file(secret_file, A_VALUE)
    shim = _no_nixl(tmp_path)
    path = os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH")) if p)
    node = duet_node(
        "prefill",
        str(tiny_llama),
        tmp_path,
        *TINY_NODE_ARGS,
        "--cluster-secret-file",
        str(secret_file),
        env={"PYTHONPATH": path},
    )
    with running(node):
        assert "falling back to the tcp backend" in node.log()
        md = await _node_metadata(node, A_VALUE)
        assert md.backend == "tcp"
        assert not await _reads(md, None)
        assert not await _reads(md, B)
        assert await _reads(md, A)


def _ucx_usable() -> None:
    if (reason := unavailable_reason("ucx")) is not None:
        (pytest.fail if strict_mode() else pytest.skip)(reason)  # CI must not pass on a skip


async def _owner_metadata(owner: PeerProcess) -> TransportMetadata:
    async with aiohttp.ClientSession() as s, s.get(owner.url("/kv/metadata")) as r:
        return decode_metadata(await r.read())


def _ucx_reader(secret: ClusterSecret | None) -> Transport:
    given = {"secret": secret} if secret is not None else {}
    return make_transport(
        "ucx",
        engine_id=f"D-{secrets.token_hex(4)}",
        timeout=30,
        metrics=KVTransferMetrics(CollectorRegistry()),
        **given,
    )


async def _ucx_reads(md: TransportMetadata, secret: ClusterSecret | None) -> bool:
    """Whether a ucx reader with `secret` reads block 3 of the owner's pool (seed 1) right."""
    pool = HostPool(TEST_LAYOUT, 2)
    async with _ucx_reader(secret) as reader:
        await reader.register_pool(pool.base, TEST_LAYOUT)
        try:
            peer = await reader.add_peer(md)
            await reader.read(peer, [3], [5])
        except PeerError:
            return False
        return bool(np.array_equal(pool.blocks[5], block_words(TEST_LAYOUT, 1, 3)))


async def test_ucx_readers_prove_the_secret() -> None:
    """The ucx backend's listener served any endpoint that connected: a reader without the
    cluster secret read every block of a prefill node's pool. Now its endpoints open with the
    same mutual HMAC handshake as tcp's. Real parts: a ucx owner process, ucx readers here."""
    _ucx_usable()
    owner = PeerProcess("ucx", "P-ucx", 1, secret=A_VALUE)
    try:
        md = await _owner_metadata(owner)
        assert await _ucx_reads(md, A)
        assert not await _ucx_reads(md, None)
        assert not await _ucx_reads(md, B)
        assert await _ucx_reads(md, A)  # the owner still serves after refusing
        wait_for(
            lambda: "refused a ucx KV reader" in owner.stderr(), what="the owner's refusal logged"
        )
    finally:
        owner.stop()


async def test_a_raw_ucx_read_request_without_the_handshake_gets_no_block() -> None:
    """An attacker's ucxx endpoint that skips the handshake and asks for blocks at once, as the
    wire format allows: it gets the owner's challenge, then nothing (no reply, no block byte).
    The owner here has no secret at all: the handshake is still required."""
    _ucx_usable()
    owner = PeerProcess("ucx", "P-ucx-raw", 7)
    try:
        md = await _owner_metadata(owner)
        async with _ucx_reader(None) as attacker:  # its UCX context, for a raw endpoint
            await attacker.register_pool(HostPool(TEST_LAYOUT, 2).base, TEST_LAYOUT)
            ucxx = import_ucxx()
            ep = await ucxx.create_endpoint(md.host, md.port)
            block = np.zeros(TEST_LAYOUT.block_bytes, dtype=np.uint8)
            received = asyncio.ensure_future(ep.recv(block, tag=(1 << 32) | 0))
            try:
                await ep.am_send(wire.encode(wire.ReadRequest(req_id=1, blocks=[0, 1])))
                first = wire.decode(bytes(await asyncio.wait_for(ep.am_recv(), 10)))
                assert isinstance(first, wire.Challenge), first
                try:  # the refusal, or the endpoint's end; never a reply that blocks follow
                    second: wire.Message | None = wire.decode(
                        bytes(await asyncio.wait_for(ep.am_recv(), 30))
                    )
                except Exception:
                    second = None
                assert second is None or (isinstance(second, wire.Reply) and second.error), second
                assert not received.done() or received.exception() is not None
                assert not block.any()
            finally:
                ep.abort()
                await asyncio.gather(received, return_exceptions=True)
        wait_for(
            lambda: "refused a ucx KV reader" in owner.stderr(), what="the owner's refusal logged"
        )
    finally:
        owner.stop()


async def test_a_ucx_nodes_pool_needs_the_secret(tiny_llama: Path, tmp_path: Path) -> None:
    """`duet node --transport ucx` gives its transport the node's cluster secret: a reader
    without it reads nothing of a real node's pool, a reader with it reads."""
    _ucx_usable()
    secret_file = tmp_path / "cluster.secret"
    write_secret_file(secret_file, A_VALUE)
    node = duet_node(
        "prefill",
        str(tiny_llama),
        tmp_path,
        *TINY_NODE_ARGS,
        "--transport",
        "ucx",
        "--cluster-secret-file",
        str(secret_file),
    )
    with running(node):
        md = await _node_metadata(node, A_VALUE)
        assert md.backend == "ucx"
        for secret, reads in ((None, False), (B, False), (A, True)):
            pool = HostPool(md.layout, 3)
            async with _ucx_reader(secret) as reader:
                await reader.register_pool(pool.base, md.layout)
                try:
                    await reader.read(await reader.add_peer(md), [0], [0])
                    got = True
                except PeerError:
                    got = False
            assert got is reads, secret

"""The tcp KV transport's handshake proves the cluster secret, both ways (issue #22: the internal
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
import secrets
import socket

import numpy as np
import pytest

from kvtransfer import PeerError, make_transport, wire
from protocol.cluster_secret import ClusterSecret
from tests.kvtransfer.pools import TEST_LAYOUT, HostPool, block_words

A = ClusterSecret(secrets.token_urlsafe(32), "test A")
B = ClusterSecret(secrets.token_urlsafe(32), "test B")


async def _read(owner_secret: ClusterSecret | None, reader_secret: ClusterSecret | None) -> tuple[bool, int]:
    """(whether the reader got block 3 right, handshakes the owner refused)."""
    owner_pool, reader_pool = HostPool(TEST_LAYOUT, 1), HostPool(TEST_LAYOUT, 2)
    async with make_transport("tcp", engine_id="P", secret=owner_secret) as owner, \
               make_transport("tcp", engine_id="D", secret=reader_secret) as reader:  # fmt: skip
        await owner.register_pool(owner_pool.base, TEST_LAYOUT)
        await reader.register_pool(reader_pool.base, TEST_LAYOUT)
        try:
            peer = await reader.add_peer(owner.metadata())
            await reader.read(peer, [3], [5])
        except PeerError:
            return False, owner.refused_handshakes
        return bool(np.array_equal(reader_pool.blocks[5], block_words(TEST_LAYOUT, 1, 3))), owner.refused_handshakes


async def test_readers_with_the_secret_read() -> None:
    assert await _read(A, A) == (True, 0)
    assert await _read(None, None) == (True, 0)  # a dev cluster without a secret still works


@pytest.mark.parametrize(("owner", "reader"), [(A, B), (A, None), (None, A)], ids=["other", "none", "owner-none"])
async def test_a_reader_with_another_secret_reads_nothing(owner: ClusterSecret | None,
                                                          reader: ClusterSecret | None) -> None:  # fmt: skip
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
        msg = wire.decode(got[wire.FRAME_HEADER.size:])
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

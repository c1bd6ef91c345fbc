"""What a tcp KV listener spends on a caller that has not proved the cluster secret.

The attack: anyone who reaches a prefill node's KV port opened connections that each sent a
4-byte length of almost 64 MiB; the owner allocated (and zero-filled) that much per connection
before checking the Hello's MAC, for the transport's 10 s timeout, so a few hundred connections
took the node's memory. Now a handshake frame is read with a small fixed maximum, the handshake
has a short deadline of its own, and connections still in it are capped per remote address and
in all (kvtransfer/tcp_transport.py).

Real parts: a tcp owner process (tests.kvtransfer.peer) with a secret, raw sockets as the
attacker's (from 127.0.0.2, so the per-address cap can be told from an honest reader's on
127.0.0.1), and an in-process tcp reader with the secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from kvtransfer import PeerError, TransportMetadata, decode_metadata, make_transport, wire
from kvtransfer.tcp_transport import MAX_PREAUTH_PER_HOST
from runtime.cluster_secret import ClusterSecret
from tests.kvtransfer.pools import TEST_LAYOUT, HostPool, block_words
from tests.kvtransfer.procs import PeerProcess
from tests.wait import wait_for

SECRET = secrets.token_urlsafe(32)
ATTACKER = "127.0.0.2"
#: a length prefix just under the wire's 64 MiB frame maximum
HUGE_PREFIX = struct.pack("<I", 0x03FFFFFF)
CONNECTIONS = 8


@pytest.fixture(scope="module")
def owner() -> Iterator[PeerProcess]:
    proc = PeerProcess("tcp", "P-preauth", 1, secret=SECRET)
    try:
        yield proc
    finally:
        proc.stop()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _connect(port: int) -> socket.socket:
    s = socket.socket()
    s.bind((ATTACKER, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def _read_challenge(s: socket.socket) -> bytes:
    """The owner's first frame, or b"" when it closed the connection without one."""
    data = b""
    while (
        len(data) < wire.FRAME_HEADER.size
        or len(data)
        < wire.FRAME_HEADER.size + (wire.FRAME_HEADER.unpack(data[: wire.FRAME_HEADER.size])[0])
    ):
        chunk = s.recv(4096)
        if not chunk:
            return b""
        data += chunk
    assert isinstance(wire.decode(data[wire.FRAME_HEADER.size :]), wire.Challenge)
    return data


def _closed_by_owner(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


async def _metadata(owner: PeerProcess) -> TransportMetadata:
    async with aiohttp.ClientSession() as s, s.get(owner.url("/kv/metadata")) as r:
        return decode_metadata(await r.read())


async def _reads(md: TransportMetadata) -> bool:
    """Whether a reader with the secret reads block 3 of the owner's pool right."""
    pool = HostPool(TEST_LAYOUT, 2)
    secret = ClusterSecret(SECRET, "test")
    async with make_transport("tcp", engine_id="D-preauth", secret=secret) as reader:
        await reader.register_pool(pool.base, TEST_LAYOUT)
        try:
            await reader.read(await reader.add_peer(md), [3], [5])
        except PeerError:
            return False
        return bool(np.array_equal(pool.blocks[5], block_words(TEST_LAYOUT, 1, 3)))


async def test_a_huge_length_before_the_handshake_allocates_nothing(owner: PeerProcess) -> None:
    md = await _metadata(owner)
    before = _rss_bytes(owner.proc.pid)
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(_connect(md.port)) for _ in range(CONNECTIONS)]
        for s in socks:
            assert _read_challenge(s)
            s.sendall(HUGE_PREFIX)
        # Either the owner closes every one of them, or it took their 64 MiB each.
        grown = CONNECTIONS * (64 << 20) // 2
        wait_for(
            lambda: (
                all(_closed_by_owner(s) for s in socks)
                or _rss_bytes(owner.proc.pid) - before > grown
            ),
            timeout=20,
            what="the owner closing the connections or allocating their frames",
        )
        growth = _rss_bytes(owner.proc.pid) - before
        assert all(_closed_by_owner(s) for s in socks), f"owner RSS grew by {growth >> 20} MiB"
        assert growth < 32 << 20, f"owner RSS grew by {growth >> 20} MiB"
    assert await _reads(md)


async def test_connections_in_the_handshake_are_capped_per_address(owner: PeerProcess) -> None:
    """An address holding its share of silent connections gets the next one closed unopened,
    and a reader on another address still reads."""
    md = await _metadata(owner)
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(_connect(md.port)) for _ in range(MAX_PREAUTH_PER_HOST)]
        for s in held:
            assert _read_challenge(s)
        extra = stack.enter_context(_connect(md.port))
        got = await asyncio.to_thread(_read_challenge, extra)
        still_held = sum(not _closed_by_owner(s) for s in held)
        # the cap holds only while the held ones are still in their handshake (3 s)
        assert still_held < MAX_PREAUTH_PER_HOST or got == b"", "a connection beyond the cap"
        assert await _reads(md)

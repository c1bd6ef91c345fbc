"""TCP backend: no extra dependency, host memory only; the fallback when NIXL is missing.

The owner listens on `host:port` (published in its metadata) and serves requests on each
accepted connection; a reader keeps a few idle connections per peer and uses one per
in-flight request, so concurrent reads never interleave on a stream.

Per request: `ReadRequest(block ids)` → `Reply(nbytes)` → the blocks' bytes in request
order. Bytes go from the owner's pool to the socket and from the socket into the reader's
pool without intermediate buffers (asyncio's `sock_sendall` / `sock_recv_into` on the
pool's memory; asyncio streams would copy every block twice more). A connection that
fails, times out or is cancelled mid-request is closed, never reused: after that no byte
can land in the reader's blocks.

Every connection starts with a mutual challenge-response over the cluster secret
(runtime/cluster_secret.py), before any request is read: the owner sends `Challenge(nonce_o)`,
the reader answers `Hello(nonce_r, HMAC(secret, "reader", nonce_o, nonce_r))`, the owner checks
it (constant time) and answers `Welcome(HMAC(secret, "owner", nonce_r, nonce_o))`, which the
reader checks. The secret never crosses the wire; a reader without it gets no block and no
notification through (the owner closes the connection), and a reader never takes bytes from an
owner that cannot prove it (a listener an attacker put at a published address). Without a
secret on either side the key is empty: the same exchange, authenticating nothing (a dev
cluster on loopback, see cluster_secret.require_secret_policy).

Before a reader has proved the secret it can cost the owner very little: handshake frames are
read with a small fixed maximum (a Hello is under 100 bytes, so a forged 64 MiB length prefix is
refused before anything is allocated), the handshake has its own short deadline, and at most
`MAX_PREAUTH_PER_HOST` connections per remote address and `MAX_PREAUTH_TOTAL` in all may be in
it at once; the others are closed on accept. The reader applies the same maximum to the owner's
Challenge and Welcome (a listener an attacker put at a published address).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

from kvtransfer import wire
from kvtransfer.base import DEFAULT_TIMEOUT, Landed, Peer, Transport
from kvtransfer.errors import BackendUnavailable, PeerError, TransferError
from kvtransfer.memory import PoolMemory
from kvtransfer.metadata import Notification, TransportMetadata
from kvtransfer.metrics import KVTransferMetrics
from kvtransfer.regions import ReadPlan, side_runs
from protocol.kv_layout import KVLayout
from runtime.cluster_secret import ClusterSecret, hmac_parts
from runtime.log_throttle import ThrottledWarning

log = logging.getLogger(__name__)

#: Idle connections kept per peer; more concurrent reads open (and then close) extra ones.
MAX_IDLE_CONNECTIONS = 4
NONCE_BYTES = 32
#: Largest handshake frame either side reads before the other proved the secret (a Hello is
#: 2 x 32 bytes plus msgpack's few bytes of framing).
HANDSHAKE_MAX_FRAME = 256
#: Seconds a connection may take to finish the handshake: one round trip, so short; the
#: transport's `timeout` is for reads of many MiB and would let idle sockets sit for long.
HANDSHAKE_TIMEOUT = 3.0
#: Connections still in the handshake, per remote address and in all; beyond these the owner
#: closes a new connection at once. A decode node opens one connection per concurrent read
#: beyond its idle ones, each in the handshake for one round trip.
MAX_PREAUTH_PER_HOST = 32
MAX_PREAUTH_TOTAL = 256
_READER, _OWNER = b"duet-kv-tcp/reader", b"duet-kv-tcp/owner"


async def _recv_exactly(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview
) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise PeerError("connection closed by the peer mid-message")
        got += k


async def _recv_message(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, limit: int = wire.MAX_FRAME
) -> wire.Message | None:
    """One framed control message of at most `limit` bytes; None on a clean EOF between
    messages. The length is checked before the body's buffer is allocated."""
    header = bytearray(wire.FRAME_HEADER.size)
    first = await loop.sock_recv_into(sock, header)
    if first == 0:
        return None
    if first < len(header):
        await _recv_exactly(loop, sock, memoryview(header)[first:])
    (size,) = wire.FRAME_HEADER.unpack(header)
    if size > limit:
        raise PeerError(f"control message of {size} bytes is larger than {limit}")
    body = bytearray(size)
    await _recv_exactly(loop, sock, memoryview(body))
    return wire.decode(body)


class TcpPeer(Peer):
    def __init__(self, metadata: TransportMetadata) -> None:
        super().__init__(metadata)
        self.idle: list[socket.socket] = []
        self.busy: set[socket.socket] = set()
        self.next_id = 0


class TcpTransport(Transport):
    backend = "tcp"

    def __init__(
        self,
        *,
        engine_id: str,
        metrics: KVTransferMetrics | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        hugepages: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        secret: ClusterSecret | None = None,
    ) -> None:
        super().__init__(engine_id=engine_id, metrics=metrics, timeout=timeout, hugepages=hugepages)
        self._key = secret.key if secret is not None else b""
        #: connections refused in the handshake (a reader without the cluster secret)
        self.refused_handshakes = 0
        #: anyone who reaches the KV port can cause these: one line per 10 s, the rest counted
        self._refused_log = ThrottledWarning(log)
        self._host = host
        self._port = port
        self._advertise = advertise_host
        self._listener: socket.socket | None = None
        self._server_task: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        #: connections in the handshake, per remote address (see MAX_PREAUTH_*)
        self._preauth: dict[str, int] = {}
        self._view: memoryview | None = None
        self._served: KVLayout | None = None

    # -- owner side ------------------------------------------------------------------

    async def _register(self, pool: PoolMemory) -> None:
        if pool.is_cuda:
            raise BackendUnavailable(
                f"the tcp backend moves host memory only; the pool is on {pool.device} "
                "(use the nixl or ucx backend)"
            )
        self._view = pool.host_view()
        self._served = pool.layout  # `self.layout` is only set once registration returns
        lsock = socket.create_server((self._host, self._port), reuse_port=False, backlog=128)
        lsock.setblocking(False)
        self._listener = lsock
        self._port = lsock.getsockname()[1]
        self._server_task = asyncio.get_running_loop().create_task(
            self._accept_loop(lsock), name=f"kvtransfer-tcp-accept-{self.engine_id}"
        )

    def _metadata_fields(self) -> dict[str, Any]:
        host = self._advertise or self._host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return {"host": host, "port": self._port}

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, addr = await loop.sock_accept(lsock)
            host = str(addr[0])
            if (
                self._preauth.get(host, 0) >= MAX_PREAUTH_PER_HOST
                or sum(self._preauth.values()) >= MAX_PREAUTH_TOTAL
            ):
                self.refused_handshakes += 1
                self._refused_log.warning(
                    "refused a KV connection from %s: too many connections in the handshake",
                    host,
                )
                conn.close()
                continue
            self._preauth[host] = self._preauth.get(host, 0) + 1
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._serve(conn, host))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _owner_handshake(self, conn: socket.socket) -> bool:
        """Challenge the reader; True once it proved the secret (and got the owner's proof)."""
        loop = asyncio.get_running_loop()
        nonce = os.urandom(NONCE_BYTES)
        await loop.sock_sendall(conn, wire.frame(wire.Challenge(nonce=nonce)))
        hello = await _recv_message(loop, conn, HANDSHAKE_MAX_FRAME)
        if (
            not isinstance(hello, wire.Hello)
            or len(hello.nonce) != NONCE_BYTES
            or not hmac.compare_digest(
                hello.mac, hmac_parts(self._key, _READER, nonce, hello.nonce)
            )
        ):
            return False
        await loop.sock_sendall(
            conn, wire.frame(wire.Welcome(mac=hmac_parts(self._key, _OWNER, hello.nonce, nonce)))
        )
        return True

    async def _serve(self, conn: socket.socket, host: str) -> None:
        loop = asyncio.get_running_loop()
        layout, view = self._served, self._view
        assert layout is not None and view is not None
        try:
            try:
                async with asyncio.timeout(min(self.timeout, HANDSHAKE_TIMEOUT)):
                    proved = await self._owner_handshake(conn)
            except (OSError, PeerError, ValueError, TimeoutError):
                proved = False  # silent, gone, oversized or not our wire format: refused
            finally:
                self._preauth[host] -= 1
                if not self._preauth[host]:
                    del self._preauth[host]
            if not proved:
                self.refused_handshakes += 1
                self._refused_log.warning(
                    "refused a KV reader from %s: it did not prove the cluster secret",
                    _peer_name(conn),
                )
                return
            while True:
                msg = await _recv_message(loop, conn)
                if msg is None:
                    return
                if isinstance(msg, wire.NotifyRequest):
                    self._deliver(Notification(engine_id=msg.sender, message=msg.message))
                    await loop.sock_sendall(conn, wire.frame(wire.Reply(req_id=msg.req_id)))
                elif isinstance(msg, wire.ReadRequest):
                    error = wire.check_blocks(msg.blocks, layout.num_blocks)
                    nbytes = 0 if error else len(msg.blocks) * layout.block_bytes
                    reply = wire.Reply(req_id=msg.req_id, error=error, nbytes=nbytes)
                    await loop.sock_sendall(conn, wire.frame(reply))
                    bb = layout.block_bytes
                    for start, count in side_runs(msg.blocks) if not error else ():
                        await loop.sock_sendall(conn, view[start * bb : (start + count) * bb])
                else:
                    return  # a reply sent to the owner: not a conversation we know
        except (OSError, PeerError, TransferError, ValueError, TimeoutError) as e:
            log.debug("tcp connection from a reader ended: %s", e)
        finally:
            conn.close()

    # -- reader side -----------------------------------------------------------------

    async def _open(self, peer: TcpPeer) -> socket.socket:
        loop = asyncio.get_running_loop()
        md = peer.metadata
        infos = await loop.getaddrinfo(md.host, md.port, type=socket.SOCK_STREAM)
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
        except OSError as e:
            sock.close()
            raise PeerError(
                f"cannot reach peer {md.engine_id!r} at {md.host}:{md.port}: {e}"
            ) from e
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            async with asyncio.timeout(min(self.timeout, HANDSHAKE_TIMEOUT)):
                await self._reader_handshake(sock, md.engine_id)
        except BaseException as e:
            sock.close()
            if isinstance(e, (OSError, TimeoutError, ValueError)):
                raise PeerError(
                    f"handshake with peer {md.engine_id!r} at {md.host}:{md.port} failed: {e!r}"
                ) from e
            raise
        return sock

    async def _reader_handshake(self, sock: socket.socket, engine_id: str) -> None:
        loop = asyncio.get_running_loop()
        challenge = await _recv_message(loop, sock, HANDSHAKE_MAX_FRAME)
        if not isinstance(challenge, wire.Challenge) or len(challenge.nonce) != NONCE_BYTES:
            raise PeerError(
                f"peer {engine_id!r} did not open the tcp handshake "
                "(it does not hold this cluster's secret, or is not a duet KV transport)"
            )
        nonce = os.urandom(NONCE_BYTES)
        mac = hmac_parts(self._key, _READER, challenge.nonce, nonce)
        await loop.sock_sendall(sock, wire.frame(wire.Hello(nonce=nonce, mac=mac)))
        welcome = await _recv_message(loop, sock, HANDSHAKE_MAX_FRAME)
        if not isinstance(welcome, wire.Welcome) or not hmac.compare_digest(
            welcome.mac, hmac_parts(self._key, _OWNER, nonce, challenge.nonce)
        ):
            raise PeerError(
                f"peer {engine_id!r} refused the tcp handshake or could not prove the cluster "
                "secret: the two nodes do not share one"
            )

    async def _connect(self, metadata: TransportMetadata) -> Peer:
        if not metadata.host or not metadata.port:
            raise PeerError(f"peer {metadata.engine_id!r} published no tcp host/port")
        peer = TcpPeer(metadata)
        peer.idle.append(await self._open(peer))  # fail now, not on the first read
        return peer

    async def _disconnect(self, peer: Peer) -> None:
        assert isinstance(peer, TcpPeer)
        for sock in [*peer.idle, *peer.busy]:
            sock.close()
        peer.idle.clear()
        peer.busy.clear()

    @contextlib.asynccontextmanager
    async def _conversation(self, peer: TcpPeer) -> AsyncIterator[socket.socket]:
        sock = peer.idle.pop() if peer.idle else await self._open(peer)
        peer.busy.add(sock)
        clean = False
        try:
            yield sock
            clean = True
        finally:
            peer.busy.discard(sock)
            if clean and peer.alive and len(peer.idle) < MAX_IDLE_CONNECTIONS:
                peer.idle.append(sock)
            else:
                sock.close()  # state unknown (error, timeout, cancel): never reuse

    async def _request(
        self, sock: socket.socket, msg: wire.ReadRequest | wire.NotifyRequest
    ) -> wire.Reply:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, wire.frame(msg))
        reply = await _recv_message(loop, sock)
        if reply is None:
            raise PeerError("connection closed by the peer")
        if not isinstance(reply, wire.Reply) or reply.req_id != msg.req_id:
            raise PeerError(f"unexpected answer from the peer: {reply!r}")
        return reply

    async def _read(self, peer: Peer, plan: ReadPlan, landed: Landed | None) -> None:
        assert isinstance(peer, TcpPeer)
        loop = asyncio.get_running_loop()
        peer.next_id += 1
        request = wire.ReadRequest(req_id=peer.next_id, blocks=list(plan.remote_ids))
        view = self.pool.host_view()
        bb = plan.block_bytes
        async with self._conversation(peer) as sock:
            reply = await self._request(sock, request)
            if reply.error:
                raise PeerError(f"peer {peer.engine_id!r} refused the read: {reply.error}")
            if reply.nbytes != plan.nbytes:
                raise PeerError(f"peer announced {reply.nbytes} bytes, expected {plan.nbytes}")
            done = 0
            for start, count in side_runs(plan.local_ids):
                await _recv_exactly(loop, sock, view[start * bb : (start + count) * bb])
                if landed is not None:  # the socket writes these blocks no more
                    landed(plan.local_ids[done : done + count])
                done += count

    async def _notify(self, peer: Peer, message: bytes) -> None:
        assert isinstance(peer, TcpPeer)
        peer.next_id += 1
        request = wire.NotifyRequest(req_id=peer.next_id, sender=self.engine_id, message=message)
        async with self._conversation(peer) as sock:
            reply = await self._request(sock, request)
            if reply.error:
                raise PeerError(f"peer {peer.engine_id!r} refused the notification: {reply.error}")

    # -- lifecycle -------------------------------------------------------------------

    async def _close(self) -> None:
        tasks = [t for t in (self._server_task, *self._handlers) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()


def _peer_name(conn: socket.socket) -> str:
    try:
        return str(conn.getpeername()[:2])
    except OSError:
        return "a closed connection"

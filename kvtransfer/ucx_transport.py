"""UCX backend over ucxx (optional extra `duet[ucx]`): tagged messages, host or CUDA pools.

ucxx's Python API has no one-sided READ (no memory keys), so this backend is two-sided:
the owner runs a ucxx listener (host/port in its metadata); a reader opens one endpoint per
peer. A read posts one tagged receive per run straight into its pool, then sends a
`ReadRequest` (runs) as an active message; the owner sends each run from its pool with the
matching tag and answers with a `Reply`. Tags carry the request id, so concurrent reads on
one endpoint never mix. UCX picks the wire: shared memory / CMA on one host, RDMA (or TCP)
between hosts, CUDA IPC / GPUDirect for device memory.

ucxx keeps one UCX context per process, so there is one ucx transport per process: it starts
the context in `register_pool` on the running loop (ucxx completes futures on the loop it
was started from) with Python futures, because ucxx's default mode waits by spinning the
loop, and `close()` resets it. Its UCX options (`ucx_options`, default
`ucx_env.UCXX_DEFAULT_OPTIONS`) apply to that context only; UCX_* variables override them.
On one host this backend's data goes over TCP loopback (see ucx_env.py): prefer nixl.
A failed, timed-out or cancelled read aborts the endpoint, which cancels its posted
receives, so no byte lands in local blocks afterwards; the peer is then re-added.

Every endpoint opens with the tcp backend's mutual HMAC challenge-response over the cluster
secret (kvtransfer/tcp_transport.py), as active messages and with this backend's own labels:
the owner serves no read and takes no notification from a reader that did not prove the
secret, and a reader takes no bytes from an owner that could not prove it. UCX itself
authenticates nobody, so this is the only check on who reads a pool; the bytes still cross
the network in clear (docs/security.md, "KV transports across machines"). Without a secret
the key is empty: the same exchange, authenticating nothing. As on tcp, the handshake has a
short deadline and at most `MAX_PREAUTH_TOTAL` endpoints in it; ucxx allocates an active
message at its sender's size before Python sees it, so only the port's reach bounds a Hello's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib
import itertools
import logging
import os
from types import ModuleType
from typing import Any

from kvtransfer import wire
from kvtransfer.base import DEFAULT_TIMEOUT, Landed, Peer, Transport
from kvtransfer.errors import BackendUnavailable, PeerError
from kvtransfer.memory import PoolMemory
from kvtransfer.metadata import Notification, TransportMetadata
from kvtransfer.metrics import KVTransferMetrics
from kvtransfer.regions import ReadPlan
from kvtransfer.tcp_transport import HANDSHAKE_TIMEOUT, MAX_PREAUTH_TOTAL, NONCE_BYTES
from kvtransfer.ucx_env import UCXX_DEFAULT_OPTIONS
from runtime.cluster_secret import ClusterSecret, hmac_parts
from runtime.log_throttle import ThrottledWarning

log = logging.getLogger(__name__)


def import_ucxx() -> ModuleType:
    """The ucxx module (import only: its UCX context starts with the first transport)."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        return importlib.import_module("ucxx")
    except ImportError as e:
        raise BackendUnavailable(f"ucxx is not importable ({e}); pip install 'duet[ucx]'") from e
    except Exception as e:  # e.g. its CUDA libraries fail to initialise
        raise BackendUnavailable(f"ucxx failed to load: {e}") from e


#: ucxx requests in flight per transport. ucxx 0.52 completes each through an asyncio future
#: from a pool its notifier thread refills; a burst beyond the pool makes its progress
#: thread create futures it cannot create, and the request is cancelled or the process
#: aborts. Runs beyond this wait for a slot (FIFO, on both sides, in run order).
MAX_INFLIGHT_REQUESTS = 32
#: the handshake's MAC labels: not the tcp backend's, so a proof is never valid on the other
_READER, _OWNER = b"duet-kv-ucx/reader", b"duet-kv-ucx/owner"


def _tag(req_id: int, index: int) -> int:
    return (req_id << 32) | index


class UcxPeer(Peer):
    def __init__(self, metadata: TransportMetadata, endpoint: Any) -> None:
        super().__init__(metadata)
        self.endpoint = endpoint
        self.replies: dict[int, asyncio.Future[wire.Reply]] = {}
        self.dispatcher: asyncio.Task[None] | None = None


class UcxTransport(Transport):
    backend = "ucx"

    def __init__(
        self,
        *,
        engine_id: str,
        metrics: KVTransferMetrics | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        hugepages: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        ucx_options: dict[str, str] | None = None,
        secret: ClusterSecret | None = None,
    ) -> None:
        super().__init__(engine_id=engine_id, metrics=metrics, timeout=timeout, hugepages=hugepages)
        self._key = secret.key if secret is not None else b""
        #: endpoints refused in the handshake (a reader without the cluster secret)
        self.refused_handshakes = 0
        #: anyone who reaches the listener can cause these: one line per 10 s, the rest counted
        self._refused_log = ThrottledWarning(log)
        self._ucxx = import_ucxx()
        self._ucx_options = dict(UCXX_DEFAULT_OPTIONS if ucx_options is None else ucx_options)
        self._owns_context = False
        self._host = host
        self._port = port
        self._listener: Any = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._server_eps: set[Any] = set()
        self._preauth = 0  # endpoints in the handshake now
        self._ids = itertools.count(1)
        self._inflight = asyncio.Semaphore(MAX_INFLIGHT_REQUESTS)

    # -- owner side ------------------------------------------------------------------

    async def _register(self, pool: PoolMemory) -> None:
        # ucxx has one UCX context per process, whose notifier thread completes futures on
        # the loop it was started from: start it here, on ours, and stop it in close().
        try:
            self._ucxx.init(
                options=self._ucx_options,
                env_takes_precedence=True,  # an operator's UCX_* variables win
                progress_mode="thread",
                enable_python_future=True,
                # Delayed submission creates requests on the progress thread, where ucxx
                # cannot refill its pool of asyncio futures: a burst of receives (one per
                # run of a scattered read) then aborts the process (ucxx 0.52).
                enable_delayed_submission=False,
            )
        except RuntimeError:
            raise BackendUnavailable(
                "ucxx is already initialised in this process; the ucx backend needs its own "
                "UCX context (one ucx transport per process)"
            ) from None
        except Exception as e:
            raise BackendUnavailable(f"ucxx cannot start UCX: {e}") from e
        self._owns_context = True
        try:
            self._listener = self._ucxx.create_listener(self._on_connect, port=self._port)
        except Exception as e:
            raise BackendUnavailable(f"ucxx cannot listen on port {self._port}: {e}") from e
        self._port = self._listener.port

    def _metadata_fields(self) -> dict[str, Any]:
        return {"host": self._host, "port": self._port}

    async def _on_connect(self, ep: Any) -> None:
        # ucxx runs this handler as a task per accepted endpoint.
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        self._server_eps.add(ep)
        try:
            self._preauth += 1
            try:  # beyond the cap: refused unchallenged
                proved = self._preauth <= MAX_PREAUTH_TOTAL and await self._owner_handshake(ep)
            finally:
                self._preauth -= 1
            if not proved:
                self.refused_handshakes += 1
                self._refused_log.warning(
                    "refused a ucx KV reader: it did not prove the cluster secret in time"
                )
                # Said before the endpoint goes: UCX may not tell the reader of an abort before
                # its own timeout, and a reader with the wrong secret should know at once.
                with contextlib.suppress(Exception):
                    refusal = wire.Reply(
                        req_id=0, error="the reader did not prove the cluster secret"
                    )
                    async with asyncio.timeout(self.timeout):
                        await ep.am_send(wire.encode(refusal))
                return
            await self._serve(ep)
        except asyncio.CancelledError:
            pass
        except Exception as e:
            log.debug("ucx reader endpoint ended: %s", e)
        finally:
            self._server_eps.discard(ep)
            if task is not None:
                self._handlers.discard(task)
            with contextlib.suppress(Exception):
                ep.abort()

    async def _owner_handshake(self, ep: Any) -> bool:
        """Challenge the reader; True once it proved the secret (and got the owner's proof)."""
        nonce = os.urandom(NONCE_BYTES)
        try:
            await ep.am_send(wire.encode(wire.Challenge(nonce=nonce)))
            limit = min(self.timeout, HANDSHAKE_TIMEOUT)
            async with asyncio.timeout(limit):
                hello = wire.decode(bytes(await ep.am_recv()))
        except asyncio.CancelledError:
            raise
        except Exception:  # gone, silent past the timeout, or not our wire format
            return False
        if (
            not isinstance(hello, wire.Hello)
            or len(hello.nonce) != NONCE_BYTES
            or not hmac.compare_digest(
                hello.mac, hmac_parts(self._key, _READER, nonce, hello.nonce)
            )
        ):
            return False
        await ep.am_send(
            wire.encode(wire.Welcome(mac=hmac_parts(self._key, _OWNER, hello.nonce, nonce)))
        )
        return True

    async def _serve(self, ep: Any) -> None:
        pending: set[asyncio.Task[None]] = set()
        try:
            while True:
                msg = wire.decode(bytes(await ep.am_recv()))
                if isinstance(msg, wire.NotifyRequest):
                    self._deliver(Notification(engine_id=msg.sender, message=msg.message))
                    await ep.am_send(wire.encode(wire.Reply(req_id=msg.req_id)))
                elif isinstance(msg, wire.ReadRequest):
                    # Serve reads concurrently: a slow reader must not stall the next request.
                    t = asyncio.get_running_loop().create_task(self._serve_read(ep, msg))
                    pending.add(t)
                    t.add_done_callback(pending.discard)
        finally:
            for t in pending:
                t.cancel()

    async def _serve_read(self, ep: Any, msg: wire.ReadRequest) -> None:
        layout = self.layout
        starts, counts = msg.blocks[0::2], msg.blocks[1::2]
        error = "" if len(starts) == len(counts) else "malformed read request"
        for s, c in zip(starts, counts, strict=False):
            if c < 1 or s < 0 or s + c > layout.num_blocks:
                error = (
                    f"blocks [{s}, {s + c}) are outside the owner's pool [0, {layout.num_blocks})"
                )
                break
        if not error:
            bb = layout.block_bytes
            sends = [
                self._bounded(ep.send, self.pool.region(s * bb, c * bb), _tag(msg.req_id, i))
                for i, (s, c) in enumerate(zip(starts, counts, strict=True))
            ]
            try:
                await asyncio.gather(*sends)
            except Exception as e:
                error = f"sending blocks failed: {e}"
        await ep.am_send(wire.encode(wire.Reply(req_id=msg.req_id, error=error)))

    # -- reader side -----------------------------------------------------------------

    async def _connect(self, metadata: TransportMetadata) -> Peer:
        if not metadata.host or not metadata.port:
            raise PeerError(f"peer {metadata.engine_id!r} published no ucx host/port")
        try:
            ep = await self._ucxx.create_endpoint(metadata.host, metadata.port)
        except Exception as e:
            raise PeerError(
                f"cannot reach peer {metadata.engine_id!r} at {metadata.host}:{metadata.port}: {e}"
            ) from e
        try:
            async with asyncio.timeout(self.timeout):
                await self._reader_handshake(ep, metadata.engine_id)
        except BaseException as e:
            with contextlib.suppress(Exception):
                ep.abort()
            if isinstance(e, Exception) and not isinstance(e, PeerError):
                raise PeerError(
                    f"handshake with peer {metadata.engine_id!r} at "
                    f"{metadata.host}:{metadata.port} failed: {e!r}"
                ) from e
            raise
        peer = UcxPeer(metadata, ep)
        peer.dispatcher = asyncio.get_running_loop().create_task(self._dispatch(peer))
        return peer

    async def _reader_handshake(self, ep: Any, engine_id: str) -> None:
        challenge = wire.decode(bytes(await ep.am_recv()))
        if not isinstance(challenge, wire.Challenge) or len(challenge.nonce) != NONCE_BYTES:
            raise PeerError(
                f"peer {engine_id!r} did not open the ucx handshake "
                "(it does not hold this cluster's secret, or is not a duet KV transport)"
            )
        nonce = os.urandom(NONCE_BYTES)
        await ep.am_send(
            wire.encode(
                wire.Hello(nonce=nonce, mac=hmac_parts(self._key, _READER, challenge.nonce, nonce))
            )
        )
        welcome = wire.decode(bytes(await ep.am_recv()))
        if not isinstance(welcome, wire.Welcome) or not hmac.compare_digest(
            welcome.mac, hmac_parts(self._key, _OWNER, nonce, challenge.nonce)
        ):
            raise PeerError(
                f"peer {engine_id!r} refused the ucx handshake or could not prove the cluster "
                "secret: the two nodes do not share one"
            )

    async def _dispatch(self, peer: UcxPeer) -> None:
        """Route the owner's replies to the reads waiting for them."""
        try:
            while True:
                msg = wire.decode(bytes(await peer.endpoint.am_recv()))
                if isinstance(msg, wire.Reply):
                    fut = peer.replies.pop(msg.req_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = PeerError(f"connection to peer {peer.engine_id!r} failed: {e}")
            for fut in peer.replies.values():
                if not fut.done():
                    fut.set_exception(error)
            peer.replies.clear()

    async def _disconnect(self, peer: Peer) -> None:
        assert isinstance(peer, UcxPeer)
        if peer.dispatcher is not None:
            peer.dispatcher.cancel()
            await asyncio.gather(peer.dispatcher, return_exceptions=True)
        with contextlib.suppress(Exception):
            peer.endpoint.abort()  # cancels receives still posted into our pool
        for fut in peer.replies.values():
            if not fut.done():
                fut.set_exception(PeerError(f"peer {peer.engine_id!r} was disconnected"))

    async def _bounded(self, op: Any, buffer: Any, tag: int) -> None:
        async with self._inflight:
            await op(buffer, tag=tag)

    async def _exchange(
        self, peer: UcxPeer, msg: wire.ReadRequest | wire.NotifyRequest
    ) -> wire.Reply:
        if peer.dispatcher is None or peer.dispatcher.done():
            raise PeerError(f"connection to peer {peer.engine_id!r} is closed")
        fut: asyncio.Future[wire.Reply] = asyncio.get_running_loop().create_future()
        peer.replies[msg.req_id] = fut
        try:
            await peer.endpoint.am_send(wire.encode(msg))
            return await fut
        finally:
            peer.replies.pop(msg.req_id, None)

    async def _read(self, peer: Peer, plan: ReadPlan, landed: Landed | None) -> None:
        assert isinstance(peer, UcxPeer)
        req_id = next(self._ids)
        bb = plan.block_bytes
        receives = [
            asyncio.ensure_future(
                self._bounded(
                    peer.endpoint.recv,
                    self.pool.region(run.local_start * bb, run.num_blocks * bb),
                    _tag(req_id, i),
                )
            )
            for i, run in enumerate(plan.runs)
        ]
        flat = [x for run in plan.runs for x in (run.remote_start, run.num_blocks)]
        try:
            reply = await self._exchange(peer, wire.ReadRequest(req_id=req_id, blocks=flat))
            if reply.error:
                raise PeerError(f"peer {peer.engine_id!r} refused the read: {reply.error}")
            await asyncio.gather(*receives)
        finally:
            for r in receives:
                r.cancel()
        if landed is not None:  # the receives complete together: nothing finer to report
            landed(plan.local_ids)

    async def _notify(self, peer: Peer, message: bytes) -> None:
        assert isinstance(peer, UcxPeer)
        msg = wire.NotifyRequest(req_id=next(self._ids), sender=self.engine_id, message=message)
        reply = await self._exchange(peer, msg)
        if reply.error:
            raise PeerError(f"peer {peer.engine_id!r} refused the notification: {reply.error}")

    # -- lifecycle -------------------------------------------------------------------

    async def _close(self) -> None:
        for ep in list(self._server_eps):
            with contextlib.suppress(Exception):
                ep.abort()
        handlers = list(self._handlers)
        for t in handlers:
            t.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._server_eps.clear()
        if self._owns_context:
            self._owns_context = False
            try:
                self._ucxx.reset()  # also stops the notifier thread, which blocks process exit
            except Exception as e:
                log.warning("ucxx context not fully released: %s", e)

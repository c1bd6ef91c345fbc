"""Reading a peer node's KV blocks into this node's pool: its metadata, its release and share
endpoints (the transport moves the bytes).

Peers are known by engine id: on first contact the peer's transport metadata is fetched from
the node itself (`GET /kv/metadata`, DESIGN §4: the data path never needs etcd) and cached;
concurrent first contacts share one fetch. A metadata answer for a different engine id means
the caller named an engine that is not at that address, and a transport address (tcp, ucx)
outside the allowed networks or not on the host the leg named is refused before the transport
connects (PeerPolicy.transport_address): the transport then connects to the checked IP address,
never to the peer's name for it. So do the HTTP calls (metadata, release); over https they check
the certificate against the name the peer goes by (`name`: the host the leg named), since a
certificate names hosts, not the addresses a name resolved to (cert-manager's have no IPs). A
nixl peer off this host is refused too, unless the KV network is stated isolated
(PeerPolicy.nixl_refusal, node/kv_network.py). Every contact goes through the PeerPolicy first
(node.peers); the cache is bounded (least recently used dropped first). One per node with a
transport (`Node.remote_kv`): the decode role reads its prefill node's blocks through it, and
every role the blocks a peer shares (node/kv_pull.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable
from typing import Any

import aiohttp
import msgspec

from kvtransfer import Peer, Transport
from node import kv_network
from node.engine_api import NodeEngine
from node.peers import PeerPolicy, PeerRefused
from protocol.node_api import KVReleaseRequest, KVShareAnswer, KVShareRelease, KVShareRequest
from protocol.openai import APIError

log = logging.getLogger("duet.decode")
#: peers whose metadata stays cached
MAX_CACHED_PEERS = 256
_JSON = {"Content-Type": "application/json"}


class PeerUnreachable(Exception):
    """The peer could not be reached (dead, or the network): a transfer failure."""


class RemoteKV:
    def __init__(
        self,
        transport: Transport,
        session: aiohttp.ClientSession,
        timeout: float,
        policy: PeerPolicy,
        scheme: str = "http",
    ) -> None:
        self.transport = transport
        #: http, or https when the plane runs TLS; the session carries the cluster secret
        self.scheme = scheme
        self.session = session
        self.timeout = timeout
        self.policy = policy
        self._peers: OrderedDict[str, asyncio.Future[Peer]] = OrderedDict()
        #: waits for failed transfers to be over (strong references until done)
        self._quarantined: set[asyncio.Task[None]] = set()

    async def peer(
        self,
        engine_id: str,
        host: str,
        port: int,
        named: tuple[str, ...],
        name: str | None = None,
    ) -> Peer:
        """The connected peer; `host` must be an address the policy allowed, one of `named` (the
        addresses of the host the leg named, `name`), where the peer's transport must be too."""
        fut = self._peers.get(engine_id)
        if fut is None:
            fut = self._peers[engine_id] = asyncio.ensure_future(
                self._connect(engine_id, host, port, named, name)
            )
            while len(self._peers) > MAX_CACHED_PEERS:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(engine_id)
        try:
            return await asyncio.shield(fut)
        except BaseException:
            if fut.done() and self._peers.get(engine_id) is fut:
                del self._peers[engine_id]  # retry on the next request
            raise

    def _tls_name(self, name: str | None) -> dict[str, Any]:
        """The request's keyword for the name an https peer's certificate must carry (the
        connection goes to the checked address, whose certificate names the host)."""
        return {"server_hostname": name} if self.scheme == "https" and name else {}

    async def _connect(
        self, engine_id: str, host: str, port: int, named: tuple[str, ...], name: str | None
    ) -> Peer:
        from kvtransfer import TransferError, decode_metadata

        url = f"{self.scheme}://{_netloc(host, port)}/kv/metadata"
        try:
            async with self.session.get(
                url, timeout=aiohttp.ClientTimeout(total=self.timeout), **self._tls_name(name)
            ) as r:
                if r.status != 200:
                    raise PeerUnreachable(f"{url} answered {r.status}")
                meta = decode_metadata(await r.content.read(1 << 20))
        except (aiohttp.ClientError, TimeoutError, OSError, TransferError) as e:
            raise PeerUnreachable(f"cannot fetch KV metadata from {host}:{port}: {e}") from e
        if meta.engine_id != engine_id:
            raise APIError(
                400,
                f"unknown remote_engine_id {engine_id!r}: {host}:{port} runs engine "
                f"{meta.engine_id!r}",
                param="kv_transfer_params",
            )
        if meta.backend == "nixl" and (why := self.policy.nixl_refusal(host)) is not None:
            log.warning("engine %s at %s:%d: %s", engine_id, host, port, why)
            raise APIError(403, why, param="kv_transfer_params", code=kv_network.CODE)
        if meta.host:  # tcp, ucx: the peer's own word on where its pool is, checked
            try:
                addr = await self.policy.transport_address(meta.host, named or (host,))
            except PeerRefused as e:
                raise APIError(
                    403,
                    f"refusing to read KV from engine {engine_id!r} at {host}:{port}: {e}",
                    param="kv_transfer_params",
                    code="peer_not_allowed",
                ) from None
            meta = msgspec.structs.replace(meta, host=addr)
        self.policy.pin(engine_id, host, port)
        try:
            peer = await self.transport.add_peer(meta)
        except TransferError as e:  # incompatible layout/backend, or the connection failed
            raise PeerUnreachable(str(e)) from e
        log.info("connected to prefill engine %s at %s:%d", engine_id, host, port)
        return peer

    def forget(self, engine_id: str) -> None:
        self._peers.pop(engine_id, None)

    async def release(
        self,
        host: str,
        port: int,
        request_id: str,
        block_ids: list[int] | None,
        name: str | None = None,
    ) -> int:
        """Tell the prefill node at `host` (an address of `name`) it may free the blocks; returns
        its HTTP status (0: unreachable)."""
        url = f"{self.scheme}://{_netloc(host, port)}/kv/release"
        try:
            body = msgspec.json.encode(KVReleaseRequest(request_id=request_id, block_ids=block_ids))
            async with self.session.post(
                url,
                data=body,
                headers=_JSON,
                timeout=aiohttp.ClientTimeout(total=5),
                **self._tls_name(name),
            ) as r:
                return r.status
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.warning("could not release %s on %s:%d: %s", request_id, host, port, e)
            return 0

    async def share(self, url: str, body: KVShareRequest, timeout: float) -> KVShareAnswer | None:
        """Ask the node at `url` to hold a prefix for us; None when it cannot (unreachable, slow,
        refused, or an answer that is not one)."""
        try:
            async with self.session.post(
                url + "/kv/share",
                data=msgspec.json.encode(body),
                headers=_JSON,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as r:
                if r.status != 200:
                    log.warning("%s/kv/share answered %d", url, r.status)
                    return None
                return msgspec.json.decode(await r.content.read(1 << 22), type=KVShareAnswer)
        except (aiohttp.ClientError, TimeoutError, OSError, msgspec.DecodeError) as e:
            log.warning("cannot get a KV share from %s: %r", url, e)
            return None

    async def release_share(self, url: str, request_id: str, block_ids: list[int]) -> int:
        """Tell the node at `url` we are done with its share; its HTTP status (0: unreachable)."""
        body = msgspec.json.encode(KVShareRelease(request_id=request_id, block_ids=block_ids))
        try:
            async with self.session.post(
                url + "/kv/share/release",
                data=body,
                headers=_JSON,
                timeout=aiohttp.ClientTimeout(total=5),
            ) as r:
                return r.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0

    def detach(self, work: Awaitable[Any]) -> None:
        """Run `work` in the background, holding it until done (its failure only logged)."""

        async def run() -> None:
            try:
                await work
            except Exception as e:
                log.warning("background KV call failed: %r", e)

        task = asyncio.ensure_future(run())
        self._quarantined.add(task)
        task.add_done_callback(self._quarantined.discard)

    def unquarantine_later(self, engine: NodeEngine, erid: str, settled: Awaitable[Any]) -> None:
        """Free the blocks a failed transfer may still write into, once the transport says
        it is over."""

        async def run() -> None:
            with contextlib.suppress(Exception):
                await settled
            n = await engine.release_quarantine(erid)
            log.info("the failed transfer of %s is over: %d quarantined blocks freed", erid, n)

        task = asyncio.ensure_future(run())
        self._quarantined.add(task)
        task.add_done_callback(self._quarantined.discard)


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

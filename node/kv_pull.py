"""Pull a prompt's prefix from a peer before computing the rest (the route's `kv_source`).

Any leg that computes a prompt (a prefill leg, a colocated or local-prefill decode leg) may
carry a `kv_source`: a node the coordinator says holds more of the prompt's prefix than this
one. Order, each step bounded by one deadline (`NodeConfig.kv_pull_timeout_s`), and any failure
a fallback to computing here — the answer never depends on the pull:
1. hash the prompt's blocks this node lacks (`from_block` .. the source's `num_blocks`, never
   the last token) with the request's own cache domain, and ask the source to share them
   (`POST /kv/share`); it holds the leading ones it has and names them with their digests;
2. check the source: on a node with a cluster its engine must be registered at the URL the
   route named (`Membership.kv_peer`), and its transport address must pass the peer policy
   (node/remote_kv.py), as for a decode node's prefill;
3. queue the request with the shared tokens as remote KV (the engine reserves blocks after its
   own prefix hit), READ the shared blocks into them (hashed as they land,
   kvtransfer/hashed_read.py), and let the engine check them against the source's digests
   (`kv_ready(..., where="peer")`): a mismatch recomputes from the first bad block, a failed
   or late read everything past the local hit;
4. release the share in the background: the digests, not the source's word, vouch for the
   bytes, so nothing waits for it.
Steps 3's transfer runs in a task the client cannot cancel: the engine always learns how the
pull ended before it may reuse blocks the transfer writes into.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from kvtransfer.hashed_read import read_hashed
from node.engine_api import EngineStream, KVCheck, KVHandoff
from protocol.block_hash import DEFAULT_HASH_SEED, block_hashes, domain_root
from protocol.node_api import KVShareAnswer, KVShareRequest
from protocol.route import KVSource
from protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from kvtransfer import Peer
    from node.leg_context import Leg
    from node.remote_kv import RemoteKV

log = logging.getLogger("duet.node")


class PrefixPull:
    def __init__(self, leg: Leg, rk: RemoteKV, source: KVSource) -> None:
        self.leg, self.rk, self.source = leg, rk, source
        cfg = leg.node.config
        self.deadline = time.monotonic() + cfg.kv_pull_timeout_s
        self.block_size = leg.node.engine.kv_layout.block_size

    def _left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def _hashes(self) -> list[int]:
        """The prompt's block hashes this node asks the source for."""
        prep, bs, src = self.leg.prep, self.block_size, self.source
        last = min(src.num_blocks, (len(prep.prompt_ids) - 1) // bs)
        if last <= src.from_block:
            return []
        seed = getattr(self.leg.node.config.engine, "hash_seed", DEFAULT_HASH_SEED)
        root = domain_root(prep.params.cache_salt, seed)
        return block_hashes(prep.prompt_ids[: last * bs], bs, seed, root)[src.from_block :]

    async def start(self, params: SamplingParams, handoff: KVHandoff) -> EngineStream:
        """Queue the request, with the shared prefix as remote KV when the source shares it;
        return its stream once the engine knows how the pull ended (or plainly queued)."""
        leg, t0 = self.leg, time.monotonic()
        hashes = self._hashes()
        share = await self._share(hashes) if hashes else None
        peer = await self._peer(share) if share is not None else None
        if share is None or peer is None:
            if share is not None:
                self._release(share)
            return await leg.add(params, handoff)
        first, n = self.source.from_block, len(share.block_ids)
        remote = replace(handoff, remote_num_tokens=(first + n) * self.block_size)
        try:
            stream = await leg.add(params, remote)
        except BaseException:
            self._release(share)
            raise
        task = asyncio.ensure_future(self._pull(stream, peer, share))
        try:
            outcome = await asyncio.shield(task)
        except asyncio.CancelledError:
            await leg.abort()  # the pull task still tells the engine how it ended
            raise
        leg.timing["kv_pull_s"] = time.monotonic() - t0
        leg.node.metrics.peer_pull(outcome, n if outcome == "ok" else 0)
        return stream

    async def _share(self, hashes: list[int]) -> KVShareAnswer | None:
        prep = self.leg.prep
        body = KVShareRequest(
            request_id=prep.request_id,
            block_hashes=hashes,
            cache_salt=prep.params.cache_salt,
            lease_s=max(1.0, 2 * self.leg.node.config.kv_pull_timeout_s),
        )
        share = await self.rk.share(self.source.url, body, self._left())
        if share is None or not share.block_ids:
            self.leg.node.metrics.peer_pull("no_share", 0)
            return None
        if len(share.block_ids) > len(hashes) or len(share.block_digests) != len(share.block_ids):
            log.warning("the KV share of %s does not fit its request; ignored", self.source.url)
            self._release(share)
            self.leg.node.metrics.peer_pull("bad_share", 0)
            return None
        return share

    async def _peer(self, share: KVShareAnswer) -> Peer | None:
        """The source's transport peer, checked as a prefill node's is; None when refused or
        unreachable (the pull is then skipped)."""
        from urllib.parse import urlsplit

        node, rk = self.leg.node, self.rk
        url = urlsplit(self.source.url)
        host, port = url.hostname or "", url.port or 0
        try:
            async with asyncio.timeout(self._left()):
                addrs = await rk.policy.resolve(host)
            reason = rk.policy.allowed(addrs[0], port, share.engine_id) if addrs else "no address"
            members = node.members
            if reason is None and members is not None:
                where = members.kv_peer(share.engine_id)
                if where is None or where[1] != port or where[0] != host:
                    reason = f"engine {share.engine_id!r} is not registered at {host}:{port}"
            if reason is not None:
                raise ValueError(reason)
            async with asyncio.timeout(self._left()):
                return await rk.peer(share.engine_id, addrs[0], port, tuple(addrs), host)
        except Exception as e:  # refused, unreachable or late: compute instead
            log.warning("not pulling KV from %s: %s", self.source.url, e)
            node.metrics.peer_pull("peer_refused", 0)
            return None

    async def _pull(self, stream: EngineStream, peer: Peer, share: KVShareAnswer) -> str:
        """Reserve, read, check: the engine learns the end in every case. Returns the outcome."""
        node, erid = self.leg.node, self.leg.engine_request_id
        first, settled, outcome = self.source.from_block, None, "timeout"
        ok, digests, hashed = False, None, None
        try:
            assert stream.reserved is not None
            async with asyncio.timeout(self._left()):
                local = await asyncio.shield(stream.reserved)
            k = stream.num_cached_blocks
            if k < first:  # this node lost blocks the share does not cover: no whole prefix
                outcome = "gap"
            else:
                assert node.transport is not None
                # hashed as they land, so the engine's check does not read them again
                hashed = await read_hashed(
                    node.transport,
                    peer,
                    share.block_ids[k - first :],
                    local[k:],
                    timeout=self._left() or 1e-3,
                )
                ok, digests = True, [None] * k + list(share.block_digests[k - first :])
        except asyncio.CancelledError:
            if stream.reserved is None or not stream.reserved.cancelled():
                raise
            outcome = "aborted"
        except TimeoutError:
            outcome = "timeout"
        except Exception as e:
            settled, outcome = getattr(e, "settled", None), "read_failed"
            self.rk.forget(peer.engine_id)
            log.warning("KV pull from %s failed: %s", self.source.url, e)
        finally:
            self._release(share)
            check = KVCheck.UNKNOWN
            with contextlib.suppress(Exception):
                check = await node.engine.kv_ready(
                    erid,
                    ok,
                    quarantine=settled is not None,
                    digests=digests,
                    where="peer",
                    hashed=hashed if ok else None,
                )
            if settled is not None:
                self.rk.unquarantine_later(node.engine, erid, settled)
        if ok:
            outcome = "mismatch" if check is KVCheck.MISMATCH else "ok"
        return outcome

    def _release(self, share: KVShareAnswer) -> None:
        """Free the share on the source, in the background (a courtesy: its lease ends it too)."""
        self.rk.detach(
            self.rk.release_share(self.source.url, self.leg.prep.request_id, share.block_ids)
        )

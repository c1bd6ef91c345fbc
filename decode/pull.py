"""One pull of a prompt's KV from its prefill node (steps 3-6 of the decode leg, decode/leg.py),
and its outcome as an enum, in the spirit of SGLang's `KVPoll`: the decode leg matches on it.

Invariants: the engine always learns the pull's end (`kv_ready`), whatever happens before (a
release that raises included), before it may free blocks the transfer writes into; P is asked to
release exactly once (its answer tells whether the bytes read are good); a read that failed but
may still write (the transport's `settled`) quarantines its blocks until the transport says it
is over; bytes read count only once the engine checked them against P's digests (a mismatch is
a failed pull: the engine recomputes from the first bad block, and the policy answers). The
bytes are hashed as they land (kvtransfer/hashed_read.py), off the engine's thread; the engine
binds those hashes to its own chain hashes and compares them with P's digests.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from kvtransfer import Peer
from kvtransfer.hashed_read import read_hashed
from node.engine_api import BytesHash, EngineStream, KVCheck
from node.legs import LegContext, RemoteKV

log = logging.getLogger("duet.decode")


class PullOutcome(enum.Enum):
    OK = "ok"
    #: the engine did not reserve blocks for the remote KV in time (the request is aborted)
    RESERVE_TIMEOUT = "reserve_timeout"
    #: P refused the release: the ids in kv_transfer_params are not that request's blocks
    NOT_THEIRS = "not_theirs"
    #: P no longer held the blocks when asked to release them: the bytes may be stale
    LEASE_EXPIRED = "lease_expired"
    #: the transport's READ failed (or P's answer to the release cannot vouch for the bytes)
    READ_FAILED = "read_failed"
    #: P could not be reached (metadata, connection, or the release)
    PEER_UNREACHABLE = "peer_unreachable"
    #: the request was aborted before its blocks were reserved
    ABORTED = "aborted"
    #: the bytes read did not match P's content digests (corrupt in transit or at P)
    DIGEST_MISMATCH = "digest_mismatch"
    #: P is not a registered prefill node of this cluster as this node sees it: never contacted
    NOT_A_MEMBER = "not_a_member"


@dataclass(frozen=True)
class Pull:
    outcome: PullOutcome
    #: why, in words (logs and the client's error under the `fail` policy); "" when OK
    detail: str = ""


OK = Pull(PullOutcome.OK)
RESERVE_TIMEOUT = Pull(PullOutcome.RESERVE_TIMEOUT, "no KV blocks could be reserved in time")
NOT_THEIRS = Pull(
    PullOutcome.NOT_THEIRS, "the prefill node says these blocks do not belong to the request"
)
ABORTED = Pull(PullOutcome.ABORTED, "the request was aborted before its blocks were reserved")
DIGEST_MISMATCH = Pull(
    PullOutcome.DIGEST_MISMATCH, "the blocks read do not match the prefill node's digests"
)


@dataclass(frozen=True)
class Source:
    """Where the KV comes from, checked: an allowed address for this engine id."""

    engine_id: str
    host: str  # an IP address the policy allowed
    port: int
    request_id: str
    block_ids: list[int]
    #: every address the named host resolves to (the peer's transport must be on one of them)
    addresses: tuple[str, ...] = ()
    #: the content digest of each of `block_ids` (None: the sender gave none)
    digests: list[int] | None = None
    #: the host as the leg named it (`host` is one of its addresses): over https, the name the
    #: prefill node's certificate must carry
    name: str | None = None


def released(status: int) -> Pull:
    """What P's answer to the release says about the bytes read before it."""
    if status == 200:
        return OK
    if status == 400:
        return NOT_THEIRS
    if status == 404:
        return Pull(
            PullOutcome.LEASE_EXPIRED, "the prefill node's lease ran out before the pull finished"
        )
    if status == 0:
        return Pull(
            PullOutcome.PEER_UNREACHABLE, "the prefill node could not be reached to release"
        )
    return Pull(PullOutcome.READ_FAILED, f"the prefill node answered {status} to the release")


class Puller:
    """Steps 3-6 for one leg: reserve, READ, release, kv_ready. `run` never raises for a failed
    pull: it returns the outcome; the leg decides the answer."""

    def __init__(self, leg: LegContext, rk: RemoteKV, src: Source, stream: EngineStream) -> None:
        self.leg, self.rk, self.src, self.stream = leg, rk, src, stream
        self.released = False
        self.settled: Awaitable[Any] | None = None
        #: the read blocks' bytes as hashed when they landed (kvtransfer/hashed_read.py)
        self.hashed: dict[int, BytesHash] | None = None
        self._ended = False

    async def run(self, peer: Peer | None, failure: Pull | None) -> Pull:
        """`failure`: the pull failed before it started (P unreachable); the blocks are still
        reserved and handed back through kv_ready, as after any failure."""
        self._ended = False
        try:
            pull = await self._run(peer, failure)
        finally:
            if not self._ended:  # cancelled or raised before `_run` told the engine
                await self._end(False)
        return pull

    async def _run(self, peer: Peer | None, failure: Pull | None) -> Pull:
        tr, node = self.leg.node.tracing, self.leg.node
        with tr.span("decode.reserve") as span:
            local = await self._reserve()
            if span is not None:
                span.set_attribute(
                    "duet.kv.outcome", local.outcome.value if isinstance(local, Pull) else "ok"
                )
        if isinstance(local, Pull):
            return local
        t_reserved = time.monotonic()
        self.leg.timing["queue_s"] = t_reserved - self.leg.prep.arrival
        moved = max(0, len(local) - self.stream.num_cached_blocks) if failure is None else 0
        with tr.span(
            "decode.kv_pull",
            {
                "duet.kv.transport": node.transport.backend if node.transport else "none",
                "duet.kv.source": self.src.engine_id,
            },
        ) as span:
            pull = failure or await self._read(peer, local)
            checked = await self._end(pull.outcome is PullOutcome.OK, len(local))
            if checked is KVCheck.MISMATCH:
                pull = DIGEST_MISMATCH
            if span is not None:
                ok = pull.outcome is PullOutcome.OK
                span.set_attributes(
                    {
                        "duet.kv.outcome": pull.outcome.value,
                        "duet.kv.blocks": moved if ok else 0,
                        "duet.kv.bytes": moved * node.engine.kv_layout.block_bytes if ok else 0,
                        "duet.kv.cached_blocks": self.stream.num_cached_blocks,
                    }
                )
                if not ok:  # the fallback D takes: prefill here (recompute) or an error (fail)
                    span.set_attributes(
                        {
                            "duet.kv.fallback": node.config.failure_policy,
                            "duet.kv.detail": pull.detail,
                        }
                    )
        self.leg.timing["transfer_s"] = time.monotonic() - t_reserved
        self._log(pull, len(local), t_reserved)
        return pull

    async def _reserve(self) -> list[int] | Pull:
        node, reserved = self.leg.node, self.stream.reserved
        assert reserved is not None
        try:
            async with asyncio.timeout(node.config.reserve_timeout_s):
                return await asyncio.shield(reserved)
        except TimeoutError:
            # Abort before the kv_ready of `_end`: a reservation that lands in between is then
            # freed by it, instead of waiting for a kv_ready that already ran.
            with contextlib.suppress(Exception):
                await node.engine.abort(self.leg.engine_request_id)
            return RESERVE_TIMEOUT
        except asyncio.CancelledError:
            if not reserved.cancelled():
                raise  # this task was cancelled
            return ABORTED

    async def _read(self, peer: Peer | None, local: list[int]) -> Pull:
        node, src, k = self.leg.node, self.src, self.stream.num_cached_blocks
        assert node.transport is not None and peer is not None
        self.hashed = None
        try:
            if k < len(local):
                # hashed as they land, so the engine's check does not read them again
                self.hashed = await read_hashed(
                    node.transport,
                    peer,
                    src.block_ids[k:],
                    local[k:],
                    timeout=node.config.transfer_timeout_s,
                )
        except Exception as e:
            self.settled = getattr(e, "settled", None)
            self.rk.forget(src.engine_id)
            return Pull(PullOutcome.READ_FAILED, f"{type(e).__name__}: {e}")
        self.released = True  # asked once, whatever the answer
        return released(
            await self.rk.release(src.host, src.port, src.request_id, src.block_ids, src.name)
        )

    def _log(self, pull: Pull, n_local: int, t_reserved: float) -> None:
        if pull.outcome is not PullOutcome.OK:
            log.warning(
                "KV pull failed (%s); policy %s", pull.detail, self.leg.node.config.failure_policy
            )
        else:
            log.info(
                "pulled %d blocks in %.1f ms",
                n_local - self.stream.num_cached_blocks,
                (time.monotonic() - t_reserved) * 1e3,
            )

    def _digests(self, n_local: int) -> list[int | None] | None:
        """P's digests aligned with the local blocks (None where the local prefix served)."""
        got, k = self.src.digests, self.stream.num_cached_blocks
        if got is None or len(got) != n_local:
            return None
        return [None] * k + list(got[k:])

    async def _end(self, ok: bool, n_local: int = 0) -> KVCheck:
        """Release on P if not yet asked, then tell the engine the pull ended (with P's digests
        to check when it went well). Runs once."""
        self._ended = True
        engine, erid = self.leg.node.engine, self.leg.engine_request_id
        check = KVCheck.UNKNOWN
        try:
            if not self.released:
                await release_quietly(self.rk, self.src)
        finally:
            digests = self._digests(n_local) if ok else None
            with contextlib.suppress(Exception):
                check = await engine.kv_ready(
                    erid,
                    ok,
                    quarantine=self.settled is not None,
                    digests=digests,
                    hashed=self.hashed if ok else None,
                )
            if self.settled is not None:
                self.rk.unquarantine_later(engine, erid, self.settled)
        return check


async def release_quietly(rk: RemoteKV, src: Source) -> None:
    """Let P free the blocks now instead of at its lease's end. The block ids go along: P frees
    only when they are exactly the request's, so a client cannot free others' blocks by naming
    their request id."""
    with contextlib.suppress(Exception):
        await rk.release(src.host, src.port, src.request_id, src.block_ids, src.name)

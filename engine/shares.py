"""Shares: a node's blocks referenced for a peer that pulls them (node/kv_share.py), any role.

A share is the leading blocks of a prompt's hashes this node holds — in its pool, or loaded
back from a spill tier and checked (engine/kv_moves.py) — each referenced once more under a
share id for a lease. They are freed when the peer releases them (claimed at once on the event
loop through the hold ledger, then freed by a command, as a held prefill's blocks are), or when
the lease runs out on the engine thread. Single-threaded like the scheduler that owns it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.holds import HoldLedger
from engine.kv_manager import KVCacheManager


@dataclass
class _Share:
    blocks: list[int]
    #: monotonic time they are freed on their own (None: claimed by a release on its way)
    expiry: float | None


class Shares:
    def __init__(self, kv: KVCacheManager, ledger: HoldLedger) -> None:
        self.kv = kv
        self.ledger = ledger
        self._shares: dict[str, _Share] = {}

    def __contains__(self, share_id: str) -> bool:
        return share_id in self._shares

    def share(
        self, share_id: str, hashes: Sequence[int], root: int, lease_s: float
    ) -> tuple[list[int], list[int]]:
        """Reference the leading blocks of `hashes` this node holds for `lease_s` seconds;
        returns them with their digests (none: nothing is held)."""
        if share_id in self._shares:
            raise ValueError(f"share id {share_id!r} is already in use")
        blocks, digests = self.kv.share(hashes, root)
        if blocks:
            expiry = time.monotonic() + lease_s
            self._shares[share_id] = _Share(blocks, expiry)
            self.ledger.add(share_id, blocks, expiry)
        return blocks, digests

    def release(self, share_id: str) -> bool:
        s = self._shares.pop(share_id, None)
        if s is None:
            return False
        self.ledger.drop(share_id)
        self.kv.pool.free(s.blocks[::-1])
        return True

    def expire(self, now: float) -> list[str]:
        """Free the shares whose lease ran out (one claimed just before is left to its
        release command); returns their ids."""
        gone = []
        for sid in [k for k, v in self._shares.items() if v.expiry is not None and v.expiry <= now]:
            if self.ledger.expire(sid):
                self.release(sid)
                gone.append(sid)
            else:
                self._shares[sid].expiry = None
        return gone

    def next_expiry(self) -> float | None:
        return min((v.expiry for v in self._shares.values() if v.expiry is not None), default=None)

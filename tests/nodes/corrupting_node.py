"""A `duet node` whose KV is corrupted after its digests were taken: what a reader must catch.

    python -m tests.nodes.corrupting_node held,share  <duet node arguments...>

held: a prefill leg's held blocks get one byte flipped in their second block right after the
hold began (its digests are taken then): the decode node reads corrupt bytes, as a fault on the
wire would deliver them. share: the first block of every share a peer asks for gets one byte
flipped after the share answered. Everything else is the real node.
"""

from __future__ import annotations

import sys

from engine.request import Request
from engine.scheduler import Scheduler
from engine.shares import Shares


def _flip(kv: object, block_id: int) -> None:
    kv.digester.row(block_id)[1000] ^= 0x55  # type: ignore[attr-defined]


def corrupt_held() -> None:
    finish = Scheduler.finish

    def flipped(self: Scheduler, req: Request, reason: str, stop_reason: object = None) -> None:
        finish(self, req, reason, stop_reason)  # type: ignore[arg-type]
        if req.request_id in self.held and len(req.block_ids) > 1:
            _flip(self.kv, req.block_ids[1])

    Scheduler.finish = flipped  # type: ignore[method-assign]


def corrupt_shares() -> None:
    share = Shares.share

    def flipped(self: Shares, *args: object, **kw: object) -> tuple[list[int], list[int]]:
        blocks, digests = share(self, *args, **kw)  # type: ignore[arg-type]
        if blocks:
            _flip(self.kv, blocks[0])
        return blocks, digests

    Shares.share = flipped  # type: ignore[method-assign]


if __name__ == "__main__":
    modes, argv = sys.argv[1].split(","), sys.argv[2:]
    for mode in modes:  # one or both
        {"held": corrupt_held, "share": corrupt_shares}[mode]()
    from duet.cli import main

    raise SystemExit(main(argv))

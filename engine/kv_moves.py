"""KV that moves, checked: reused pool blocks, spilled blocks loaded back, blocks a prefill node
sends or a peer shares — each checked against its content digest before a request uses it
(protocol/kv_digest.py). Functions of the KV manager (engine/kv_manager.py) it calls, kept here
so the manager stays the block-table bookkeeping it was.

Failing closed: a block whose bytes do not match its digest is never used. A released pool
block is uncached, a spilled one dropped from its tier, a transferred one recomputed from that
block on; every check and mismatch is counted by where the KV came from (`kv.checks`,
`kv.mismatches`: "pool", "host", "disk", "transfer", "peer") and each mismatch logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from engine.request import Request
from protocol.block_hash import domain_root
from protocol.kv_digest import BytesHash, KVCheck, finish_digest, tail_chain_hash

if TYPE_CHECKING:
    from engine.kv_manager import KVCacheManager
    from engine.kv_tiers import Medium

log = logging.getLogger("duet.engine")


def _mismatch(kv: KVCacheManager, where: str, what: str) -> None:
    kv.mismatches[where] += 1
    log.warning("KV digest mismatch (%s): %s; dropped, its tokens are recomputed", where, what)


def _root(kv: KVCacheManager, req: Request) -> int:
    return domain_root(req.params.cache_salt, kv.hash_seed)


def checked_hits(kv: KVCacheManager, req: Request, cached: list[int]) -> list[int]:
    """`cached` up to its first released block whose KV no longer matches its digest (that
    block is uncached: recomputed by this request, and by no one after it). Blocks other
    requests reference are in use as they are; a block without a digest is taken as is."""
    if kv.digester is None or not cached:
        return cached
    hs = kv.block_hashes(req, len(cached) * kv.block_size)
    root = _root(kv, req)
    for i, b in enumerate(cached):
        want = kv.pool.digest(b)
        if kv.pool.ref_count(b) or want is None:
            continue
        kv.checks["pool"] += 1
        if kv.digester.digest(b, hs[i], root) != want:
            _mismatch(kv, "pool", f"block {i} of request {req.request_id}")
            kv.pool.uncache(b)
            return cached[:i]
    return cached


def load_block(
    kv: KVCacheManager, h: int, root: int, parent: int | None, tokens: list[int]
) -> tuple[int, Medium] | None:
    """Load spilled block `h` into a fresh pool block (referenced once), check it against the
    digest it was spilled with, and cache it. None when it cannot be read or fails (then it
    is gone from this node)."""
    assert kv.tiers is not None and kv.digester is not None
    (b,) = kv.pool.allocate(1)
    got = kv.tiers.load(h, b)  # takes the entry out of its tier (pins and all)
    if got is not None:
        medium, want = got
        kv.checks[medium.value] += 1
        if kv.digester.digest(b, h, root) == want:
            kv.pool.set_digest(b, want)
            kv.pool.cache(b, h, parent, tokens)
            return b, medium
        _mismatch(kv, medium.value, f"spilled block {h:016x}")
        kv.tiers.drop(h, medium)
    kv.pool.free([b])
    return None


def load_tiered(kv: KVCacheManager, req: Request, hashes: Sequence[int], count: bool) -> None:
    """Bring the spilled blocks `hashes` back after the request's pool prefix (admission: the
    request computes after them), each checked; stop at the first that cannot be used."""
    assert kv.tiers is not None
    bs = kv.block_size
    for h in hashes:
        kv.tiers.pin(h)  # the allocations below may spill other blocks into the tiers
    try:
        hs = kv.block_hashes(req, (len(req.block_ids) + len(hashes)) * bs)
        root = _root(kv, req)
        for h in hashes:
            i = len(req.block_ids)
            toks = [req.token_at(j) for j in range(i * bs, (i + 1) * bs)]
            got = load_block(kv, h, root, hs[i - 1] if i else None, toks)
            if got is None:
                break
            req.block_ids.append(got[0])
            if count:
                kv.reused[got[1].value] += bs
    finally:
        for h in hashes:
            kv.tiers.unpin(h)


def share(kv: KVCacheManager, hashes: Sequence[int], root: int) -> tuple[list[int], list[int]]:
    """The leading blocks of `hashes` this node holds — in its pool, or loaded back from a
    spill tier (checked) — each referenced once more for a peer that pulls them, with their
    digests. The caller frees them when the peer is done."""
    tiers, blocks, digests = kv.tiers, [], []
    if tiers is not None:
        for h in hashes:
            tiers.pin(h)
    try:
        for i, h in enumerate(hashes):
            b = kv.pool.lookup(h)
            if b is not None and kv.pool.digest(b) is not None:
                kv.pool.touch([b])
            elif b is None and tiers is not None and tiers.where(h) is not None:
                got = load_block(kv, h, root, hashes[i - 1] if i else None, [])
                if got is None:
                    break
                b = got[0]
            else:
                break
            blocks.append(b)
            digests.append(kv.pool.digest(b) or 0)
    finally:
        if tiers is not None:
            for h in hashes:
                tiers.unpin(h)
    return blocks, digests


def _chain(kv: KVCacheManager, req: Request, i: int, upto: int) -> int:
    """The chain hash block `i` of `req` is digested with, its KV covering `upto` tokens: the
    block hash of a full block, the tail chain hash of the partial last one."""
    bs = kv.block_size
    if (i + 1) * bs <= upto:
        return kv.block_hashes(req, upto)[i]
    parent = kv.block_hashes(req, upto)[i - 1] if i else _root(kv, req)
    return tail_chain_hash(parent, [req.token_at(j) for j in range(i * bs, upto)], kv.hash_seed)


def transfer_digests(kv: KVCacheManager, req: Request) -> list[int] | None:
    """Digests of every block of `req` over its computed tokens (a held prefill's, for the
    node that pulls them): a full block's as taken when written, the tail's now."""
    if kv.digester is None:
        return None
    upto, root = req.num_computed_tokens, _root(kv, req)
    out = []
    for i, b in enumerate(req.block_ids):
        full = (i + 1) * kv.block_size <= upto
        d = kv.pool.digest(b) if full else None
        if d is None:
            d = kv.digester.digest(b, _chain(kv, req, i, upto), root)
            if full:
                kv.pool.set_digest(b, d)
        out.append(d)
    return out


def verify(
    kv: KVCacheManager,
    req: Request,
    digests: Sequence[int | None],
    upto: int,
    where: str,
    hashed: Mapping[int, BytesHash] | None = None,
) -> int:
    """Check the blocks of `req` whose KV arrived (`digests[i]` not None) against the sender's
    digests, their KV covering `upto` tokens. Returns how many leading blocks are good: all of
    them, or up to the first mismatch. A verified full block keeps its digest. A block in
    `hashed` (its bytes hashed as they landed, by block id) is bound and compared without
    hashing its bytes again; any other is hashed here."""
    if kv.digester is None:
        return len(digests)
    root = _root(kv, req)
    for i, want in enumerate(digests):
        if want is None:
            continue
        b = req.block_ids[i]
        kv.checks[where] += 1
        state = hashed.get(b) if hashed is not None else None
        chain = _chain(kv, req, i, upto)
        got = (
            kv.digester.digest(b, chain, root)
            if state is None
            else finish_digest(state, chain, root)
        )
        if got != want:
            _mismatch(kv, where, f"block {i} of request {req.request_id}")
            return i
        if (i + 1) * kv.block_size <= upto:
            kv.pool.set_digest(b, got)
    return len(digests)


def arrived(
    kv: KVCacheManager,
    req: Request,
    digests: Sequence[int | None] | None,
    where: str,
    hashed: Mapping[int, BytesHash] | None = None,
) -> KVCheck:
    """A transfer into `req`'s reserved blocks went well: its tokens count as computed — a whole
    prompt's but the last (recomputed for its logits), a pulled prefix's all — as far as the
    blocks match the sender's `digests` (aligned with the request's blocks; None where nothing
    was transferred), and its full blocks enter the prefix cache."""
    n = req.remote_num_tokens
    cover = n - 1 if n >= req.num_prompt_tokens else n
    check = KVCheck.READY
    if digests is not None:
        good = verify(kv, req, digests, n, where, hashed)
        if good < len(digests):
            check = KVCheck.MISMATCH
            cover = min(cover, good * kv.block_size)
    req.num_computed_tokens = max(req.num_computed_tokens, cover)
    kv.cache_computed_blocks(req)
    return check
